"""batchbound.study: batch-size sweeps from one TOML spec to an HTML report.

spec (TOML) → plan (TrainConfig fields per run) → executor → store (SQLite, keyed by config
hash) → analysis (pure functions over DataFrames) → plots (take an ``ax``) → report.

>>> from batchbound.study import load_study, run_study
>>> spec = load_study("width-depth-digits")              # a file path or a packaged preset
>>> outcome = run_study(spec, "runs/study.db", jobs=2)     # doctest: +SKIP
"""

from batchbound.study.plan import Plan, PlannedRun, make_plan
from batchbound.study.runner import StudyOutcome, run_study
from batchbound.study.spec import StudySpec, load_study, preset_names, study_from_dict
from batchbound.study.store import Store, export

__all__ = [
    "Plan",
    "PlannedRun",
    "Store",
    "StudyOutcome",
    "StudySpec",
    "export",
    "load_study",
    "make_plan",
    "preset_names",
    "run_study",
    "study_from_dict",
]
