"""batchbound.data: a registry of data sets addressed by spec strings, the transforms the
studies apply to them, and the index sampler the trainer draws batches with.

>>> from batchbound.data import load_dataset
>>> ds = load_dataset("digits")
>>> ds.n_train, ds.input_shape, ds.task
(1438, (64,), 'classification')

Image sets are (n, C, H, W) float32 (mnist5k, fashion-mnist, cifar10, ...); mnist1d is
(n, 1, 40); digits is flat (64,) unless ``digits(image=true)``. Text sets (fortunes,
text(path=FILE)) are (n, context) int64 token ids with next-token targets. See docs/data.md.
"""

# Importing these modules registers their data sets.
from batchbound.data import embedded as _embedded  # noqa: F401
from batchbound.data import files as _files  # noqa: F401
from batchbound.data import text as _text  # noqa: F401
from batchbound.data.dataset import CLASSIFICATION, REGRESSION, TASKS, TEXT, Dataset
from batchbound.data.registry import (
    DatasetEntry,
    dataset_names,
    get_entry,
    load_dataset,
    register_dataset,
    resolve_data_dir,
)
from batchbound.data.sampler import BatchSampler
from batchbound.data.transforms import apply_transform, neighbour_pair, transform_names

__all__ = [
    "CLASSIFICATION",
    "REGRESSION",
    "TASKS",
    "TEXT",
    "BatchSampler",
    "Dataset",
    "DatasetEntry",
    "apply_transform",
    "dataset_names",
    "get_entry",
    "load_dataset",
    "neighbour_pair",
    "register_dataset",
    "resolve_data_dir",
    "transform_names",
]
