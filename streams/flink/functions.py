"""The Python functions of the Flink feature job, vectorized: each call gets a whole Arrow batch of windows.

Only what Flink lacks runs here (``streams.flink.job`` does the rest in the JVM):

- ``band_energy_function``: the share of a window's spectral energy at or above the cut, from the
  window's event times and values that ``ARRAY_AGG`` collected; the batch's windows go through
  ``streams.features.compute.band_energies`` (one batched FFT per window length), the code the embedded
  engine runs;
- ``online_store_function``: writes the batch's rows to the online store, Feast's Redis layout
  (``streams.features.online.OnlineWriter``: one command per batch, Feast's newest-wins rule inside
  Redis, so the rewrite of a window after a restore from a checkpoint changes nothing); returns the
  window's reading count unchanged, so the sink's rows carry it through.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from pyflink.table import DataTypes
from pyflink.table.udf import ScalarFunction, udf

from streams.features.compute import band_energies
from streams.features.spec import FeatureSet


def band_energy_function(hz: float, cut_hz: float):
    """A pandas UDF ``(ARRAY<BIGINT> times, ARRAY<DOUBLE> values) -> DOUBLE``, one value per window."""

    def band_energy(times: pd.Series, values: pd.Series) -> pd.Series:
        t = [np.asarray(x, dtype=np.int64) for x in times]
        v = [np.asarray(x, dtype=np.float64) for x in values]  # a null value (missing) becomes NaN
        return pd.Series(band_energies(t, v, hz, cut_hz))

    return udf(band_energy, result_type=DataTypes.DOUBLE(), func_type="pandas")


class _OnlineStore(ScalarFunction):
    """Writes each batch of window rows to Feast's Redis layout; returns the counts unchanged."""

    def __init__(self, fs: FeatureSet, redis_url: str, project: str):
        self.fs, self.redis_url, self.project = fs, redis_url, project  # the declaration travels with the function

    def open(self, function_context) -> None:
        from streams.features.layout import FeastLayout
        from streams.features.online import OnlineWriter

        self.store = OnlineWriter(self.redis_url, FeastLayout.of(self.fs, self.project))
        self.store.setup()

    def eval(self, entity: pd.Series, start: pd.Series, end: pd.Series, count: pd.Series, *features: pd.Series):
        names = self.fs.feature_names
        for i in range(len(entity)):
            self.store.stage({self.fs.entity.join_key: entity.iat[i], "window_start": int(start.iat[i]),
                              "window_end": int(end.iat[i]), "count": int(count.iat[i]),
                              **{name: float(column.iat[i]) for name, column in zip(names, features)}})
        self.store.flush()
        return count

    def close(self) -> None:
        self.store.close()

    def is_deterministic(self) -> bool:
        return False  # a side effect: never folded, reused or dropped by the planner


def online_store_function(fs: FeatureSet, redis_url: str, project: str):
    """A pandas UDF ``(key, window_start ms, window_end ms, count, features...) -> count`` writing the online store."""
    return udf(_OnlineStore(fs, redis_url, project), result_type=DataTypes.BIGINT(), func_type="pandas")
