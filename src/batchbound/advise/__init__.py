"""``batchbound.advise``: how many workers, what batch size, how long.

The public names, re-exported; the logic is in the modules: ``advice.py`` (``advise()``,
``advise_from_study()``, ``Advice``: the pilot, branches, timing and rows put together),
``pilot.py``, ``critical.py``, ``trajectory.py``, ``iterations.py``, ``timing.py``,
``answer.py``.
"""

from __future__ import annotations

from batchbound.advise.advice import Advice, advise, advise_from_study
from batchbound.advise.iterations import Pilot, predict_iterations
from batchbound.advise.timing import Cluster, load_cluster

__all__ = ["Advice", "Cluster", "Pilot", "advise", "advise_from_study", "load_cluster",
           "predict_iterations"]
