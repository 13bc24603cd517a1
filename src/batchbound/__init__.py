"""batchbound: gradient diversity, the batch-size bound B = n·Δ(w), data-parallel SGD and
batch-size studies for PyTorch.

The rooms, each importable without the ones after it:
``data`` and ``models`` → ``diversity`` → ``train`` → ``study``; ``cli`` sits over all of them.
"""

__version__ = "0.1.0"
