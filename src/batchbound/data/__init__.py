"""batchbound.data: a registry of data sets addressed by spec strings.

>>> from batchbound.data import load_dataset
>>> ds = load_dataset("digits")
>>> ds.n_train, ds.input_shape, ds.task
(1438, (64,), 'classification')
"""

# Importing these modules registers their data sets.
from batchbound.data import embedded as _embedded  # noqa: F401
from batchbound.data import files as _files  # noqa: F401
from batchbound.data.dataset import CLASSIFICATION, REGRESSION, Dataset
from batchbound.data.registry import (
    DatasetEntry,
    dataset_names,
    get_entry,
    load_dataset,
    register_dataset,
    resolve_data_dir,
)

__all__ = [
    "CLASSIFICATION",
    "REGRESSION",
    "Dataset",
    "DatasetEntry",
    "dataset_names",
    "get_entry",
    "load_dataset",
    "register_dataset",
    "resolve_data_dir",
]
