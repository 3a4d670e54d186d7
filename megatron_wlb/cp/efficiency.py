"""Achieved attention-kernel throughput by shard shape: the table behind the ``adaptive`` layout.

Flash-attention style kernels work on tiles (typically 128 queries x 128 keys). A query run of
``q`` queries ending at key ``kv`` costs about as much as the tile-padded shape
``(ceil(q/tile)*tile, ceil(kv/tile)*tile)``, and small shapes also reach a lower fraction of peak
(prologue/epilogue per query tile, fewer key tiles to pipeline). WLB-LLM (OSDI'25, Sec. 5.3)
estimates a layout's latency as tile-padded FLOPs divided by the *achieved* TFLOPs looked up in an
offline-profiled table indexed by shard shape; :class:`KernelEfficiency` is that table.

Table format (JSON, ``megatron-wlb-attn-efficiency/1``)::

    {"format": "megatron-wlb-attn-efficiency/1", "device": str, "source": str, "tile": int,
     "q_lens": [int, ...], "kv_lens": [int, ...],            # strictly increasing grid axes
     "tflops": [[float | null, ...], ...]}                  # [len(q_lens)][len(kv_lens)]

``tflops[i][j]`` is the achieved forward TFLOP/s of a causal (bottom-right aligned) query run of
``q_lens[i]`` queries attending ``kv_lens[j]`` keys, FLOPs counted as 4 * heads * head_dim per
(query, key) pair. Cells with ``q > kv`` are impossible shapes and may be ``null``; they are filled
from the diagonal. ``scripts/gpu_profile_attention.py`` measures and writes such a table.

The shipped default (``data/default_efficiency.json``) is NOT a measurement: it is the smooth
placeholder ``480 * kv/(kv+512) * q/(q+64)`` TFLOP/s (asymptote = ``Hardware.attention_tflops`` of
the analytic H100 model), written by :func:`default_table`. Replace it with a measured table via
``KernelEfficiency.from_json`` (``wlb shard --kernel-table``) before trusting adaptive decisions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

EFFICIENCY_FORMAT = "megatron-wlb-attn-efficiency/1"
DEFAULT_TABLE = Path(__file__).with_name("data") / "default_efficiency.json"


@dataclass(frozen=True)
class KernelEfficiency:
    """Achieved attention TFLOP/s on a (q_len, kv_len) grid, bilinear in log2 space, clamped.

    Besides the table it holds derived state, set once in ``__post_init__``: the grid axes in log2
    (``log_q_lens``, ``log_kv_lens``) and ``tile_grids``, a cache of ``_tile_grid`` per tile size
    (the one mutable part: filled on first use, never changes a lookup's result).
    """

    q_lens: np.ndarray
    kv_lens: np.ndarray
    table: np.ndarray  # float64 [len(q_lens), len(kv_lens)], TFLOP/s, no NaN after validation
    tile: int = 128
    device: str = "unknown"
    source: str = ""
    log_q_lens: np.ndarray = field(init=False, repr=False, compare=False)
    log_kv_lens: np.ndarray = field(init=False, repr=False, compare=False)
    tile_grids: dict[int, np.ndarray | None] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        q = np.asarray(self.q_lens, dtype=np.float64)
        kv = np.asarray(self.kv_lens, dtype=np.float64)
        t = np.array(self.table, dtype=np.float64)
        for name, axis in (("q_lens", q), ("kv_lens", kv)):
            if axis.ndim != 1 or axis.size < 1:
                raise ValueError(f"KernelEfficiency.{name} must be a non-empty 1-D list, got shape {axis.shape}")
            if np.any(axis < 1) or np.any(np.diff(axis) <= 0):
                raise ValueError(f"KernelEfficiency.{name} must be positive and strictly increasing, "
                                 f"got {axis.tolist()}")
        if t.shape != (q.size, kv.size):
            raise ValueError(f"KernelEfficiency.table has shape {t.shape}, expected (len(q_lens), len(kv_lens)) = "
                             f"{(q.size, kv.size)}")
        if not isinstance(self.tile, int | np.integer) or self.tile < 1:
            raise ValueError(f"KernelEfficiency.tile must be a positive integer, got {self.tile!r}")
        # Impossible shapes (q > kv) may be missing: take the value of the square shape (kv, kv).
        missing = ~np.isfinite(t)
        if missing.any():
            for i, j in zip(*np.nonzero(missing)):
                diag = int(np.searchsorted(q, kv[j], side="right")) - 1
                if q[i] <= kv[j] or diag < 0 or not np.isfinite(t[diag, j]):
                    raise ValueError(f"KernelEfficiency.table[{i}][{j}] (q={q[i]:g}, kv={kv[j]:g}) is missing; "
                                     "only impossible shapes with q > kv may be null")
                t[i, j] = t[diag, j]
        if np.any(t <= 0):
            raise ValueError("KernelEfficiency.table holds a non-positive TFLOP/s value")
        object.__setattr__(self, "q_lens", q)
        object.__setattr__(self, "kv_lens", kv)
        object.__setattr__(self, "table", t)
        object.__setattr__(self, "log_q_lens", np.log2(q))
        object.__setattr__(self, "log_kv_lens", np.log2(kv))

    def _tile_grid(self, tile: int) -> np.ndarray | None:
        """Relative efficiency at every (i*tile, j*tile), i, j >= 1, up to the grid's end (cached;
        None when that would exceed 2048 x 2048 cells)."""
        if tile not in self.tile_grids:
            n = int(-(-max(self.q_lens[-1], self.kv_lens[-1]) // tile))
            if n > 2048:
                self.tile_grids[tile] = None
            else:
                axis = np.arange(1, n + 1, dtype=np.float64) * tile
                self.tile_grids[tile] = self.relative(axis[:, None], axis[None, :])
        return self.tile_grids[tile]

    def relative_padded(self, q_pad: np.ndarray, kv_pad: np.ndarray, tile: int) -> np.ndarray:
        """:meth:`relative` for shapes that are multiples of ``tile`` (a table lookup, no interpolation)."""
        dense = self._tile_grid(tile)
        if dense is None:
            return self.relative(q_pad, kv_pad)
        last = dense.shape[0] - 1
        qi = np.minimum(q_pad // tile - 1, last)
        ki = np.minimum(kv_pad // tile - 1, last)
        return dense[qi, ki]

    @property
    def peak(self) -> float:
        """The highest achieved TFLOP/s in the table (large shapes): the 'efficiency 1' reference."""
        return float(self.table.max())

    @staticmethod
    def _axis(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if grid.size == 1:
            return np.zeros(x.shape, dtype=np.int64), np.zeros(x.shape)
        i = np.minimum(np.maximum(np.searchsorted(grid, x, side="right") - 1, 0), grid.size - 2)
        t = np.minimum(np.maximum((x - grid[i]) / (grid[i + 1] - grid[i]), 0.0), 1.0)
        return i, t

    def tflops(self, q_len: np.ndarray | int, kv_len: np.ndarray | int) -> np.ndarray:
        """Achieved TFLOP/s for query runs of shape (q_len, kv_len) (vectorised, clamped to the grid)."""
        x = np.log2(np.maximum(np.asarray(q_len, dtype=np.float64), 1.0))
        y = np.log2(np.maximum(np.asarray(kv_len, dtype=np.float64), 1.0))
        x, y = np.broadcast_arrays(x, y)
        i, tx = self._axis(self.log_q_lens, x)
        j, ty = self._axis(self.log_kv_lens, y)
        t = self.table
        if self.q_lens.size == 1:
            i1 = i
        else:
            i1 = i + 1
        j1 = j if self.kv_lens.size == 1 else j + 1
        top = t[i, j] * (1 - ty) + t[i, j1] * ty
        bot = t[i1, j] * (1 - ty) + t[i1, j1] * ty
        return top * (1 - tx) + bot * tx

    def relative(self, q_len: np.ndarray | int, kv_len: np.ndarray | int) -> np.ndarray:
        """Achieved / peak TFLOP/s, in (0, 1]: divide an ideal-throughput latency by it."""
        return self.tflops(q_len, kv_len) / self.peak

    # -- I/O ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": EFFICIENCY_FORMAT, "device": self.device, "source": self.source, "tile": int(self.tile),
                "q_lens": [int(v) for v in self.q_lens], "kv_lens": [int(v) for v in self.kv_lens],
                "tflops": [[float(f"{v:.6g}") for v in row] for row in self.table]}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: dict, where: str = "efficiency table") -> KernelEfficiency:
        if data.get("format") != EFFICIENCY_FORMAT:
            raise ValueError(f"{where}: format is {data.get('format')!r}, expected {EFFICIENCY_FORMAT!r}")
        for key in ("q_lens", "kv_lens", "tflops"):
            if key not in data:
                raise ValueError(f"{where}: missing key {key!r}")
        if data.get("partial"):
            raise ValueError(f"{where}: a partial table (its sweep was stopped or is still running); "
                             "use a complete one")
        table = np.array([[np.nan if v is None else v for v in row] for row in data["tflops"]], dtype=np.float64)
        try:
            return cls(np.asarray(data["q_lens"]), np.asarray(data["kv_lens"]), table,
                       tile=int(data.get("tile", 128)), device=str(data.get("device", "unknown")),
                       source=str(data.get("source", "")))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> KernelEfficiency:
        """Load a table written by ``scripts/gpu_profile_attention.py`` (or :meth:`to_json`)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"efficiency table {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def flat(cls) -> KernelEfficiency:
        """Every shape runs at the same rate (``relative`` = 1): for a cost model whose attention was
        measured on whole micro-batches, which holds the kernel's efficiency itself."""
        grid = np.array([1.0, float(2**30)])
        return cls(grid, grid, np.ones((2, 2)), tile=1, device="any (flat)", source="KernelEfficiency.flat")

    @classmethod
    def default(cls) -> KernelEfficiency:
        """The shipped placeholder table (see the module docstring); loaded once."""
        return _default_table()


@lru_cache(maxsize=1)
def _default_table() -> KernelEfficiency:
    return KernelEfficiency.from_json(DEFAULT_TABLE)


def default_table(peak_tflops: float = 480.0, tile: int = 128) -> KernelEfficiency:
    """The placeholder model ``peak * kv/(kv+512) * q/(q+64)`` on a power-of-two grid 128..128K.

    Shape only: small key ranges pay a fixed per-query-tile cost (~4 key tiles' worth) and small
    query runs keep fewer warps busy. Not measured; regenerate ``data/default_efficiency.json``
    with ``python -m megatron_wlb.cp.efficiency`` after changing it.
    """
    grid = np.array([tile * 2**i for i in range(11)], dtype=np.float64)
    q, kv = np.meshgrid(grid, grid, indexing="ij")
    t = peak_tflops * kv / (kv + 512.0) * q / (q + 64.0)
    return KernelEfficiency(grid, grid, t, tile=tile, device="H100-SXM (placeholder model, not measured)",
                            source="megatron_wlb.cp.efficiency.default_table: peak*kv/(kv+512)*q/(q+64)")


if __name__ == "__main__":
    default_table().to_json(DEFAULT_TABLE)
    print(f"wrote {DEFAULT_TABLE}")
