"""Training data: a byte corpus, disjoint per-unit shards, deterministic batches, a held-out split.

The pipeline, top to bottom:

    load_corpus()            -> bytes            default: the interpreter's stdlib *.py files
    split_corpus()           -> CorpusSplit      train = the head, held-out = the tail
    shard_for_unit()         -> np.ndarray       unit i gets the i-th contiguous slice of train
    BatchSampler.batch(step) -> (B, T + 1)       random windows of one shard, a pure function of
                                                 (seed, unit, step) so a restarted unit can resume
    eval_batches()           -> (NB, B, T + 1)   fixed, evenly spaced windows of the held-out tail

Everything is deterministic given its arguments: no global RNG state, sorted file lists.
"""

import os
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np

# Directories that hold third-party packages, not the standard library.
_THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})


class CorpusError(ValueError):
    """The corpus cannot be used: a missing path, no usable bytes, or too few bytes for the job."""


# -------------------------------------------------------------------------------------------------
# Corpus


def _walk_files(
    root: pathlib.Path, skip_dirs: frozenset[str] = frozenset(), suffix: str = ""
) -> list[pathlib.Path]:
    """All regular files under `root` (with the extension `suffix`, if given; not sockets,
    FIFOs or broken symlinks), skipping hidden directories and `skip_dirs`, sorted.

    Sorting by the relative path's components (not by walk order, which depends on the file
    system) makes the result identical on every machine holding the same tree. Every service
    process walks the standard library at its start (thousands of entries), so the walk reads
    each directory once (``os.scandir``: a file's type comes with its entry) and makes paths
    only for the files it keeps.
    """
    found: list[tuple[tuple[str, ...], str]] = []

    def walk(folder: str, parts: tuple[str, ...]) -> None:
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError:
            return  # unreadable, as os.walk skips it
        for entry in entries:
            if entry.is_dir():  # a symlink to a folder is not followed, nor kept as a file
                hidden = entry.name.startswith(".") or entry.name in skip_dirs
                if not (hidden or entry.is_symlink()):
                    walk(entry.path, (*parts, entry.name))
            elif (not suffix or os.path.splitext(entry.name)[1] == suffix) and entry.is_file():
                found.append(((*parts, entry.name), entry.path))

    walk(str(root), ())
    return [pathlib.Path(path) for _, path in sorted(found)]


def corpus_within(corpus: str, root: str | os.PathLike | None) -> pathlib.Path:
    """The corpus path a job may use: a regular file or a folder that resolves (symlinks and
    ``..`` followed) inside ``root``.

    Raises:
        CorpusError: no root is configured, or the path leaves it, does not exist, or is not a
            regular file or folder (``/dev/zero``, a socket, ...).
    """
    if root is None:
        raise CorpusError(
            "this gateway takes no corpus paths (start it with --data-root to allow those "
            "under one folder); leave corpus out to train on the built-in corpus"
        )
    base = pathlib.Path(root).resolve()
    path = (base / corpus).resolve()
    if not path.is_relative_to(base):
        raise CorpusError(f"corpus {corpus!r} is outside the data root {base}")
    if not path.exists():
        raise CorpusError(f"corpus {corpus!r} does not exist under the data root {base}")
    if not (path.is_file() or path.is_dir()):
        raise CorpusError(f"corpus {corpus!r} is neither a regular file nor a folder")
    return path


def default_corpus_files() -> list[pathlib.Path]:
    """The default corpus: Python standard-library source files of the running interpreter.

    Returns:
        Sorted paths of every *.py file under `sysconfig.get_paths()["stdlib"]`, excluding
        site-packages / dist-packages (third-party code) and hidden directories.

    Raises:
        CorpusError: If the standard-library directory is missing or holds no *.py files (e.g. an
            embedded interpreter shipped without sources).
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise CorpusError(f"standard-library directory not found: {stdlib}")
    files = _walk_files(stdlib, _THIRD_PARTY_DIRS, ".py")
    if not files:
        raise CorpusError(f"no *.py files under the standard-library directory {stdlib}")
    return files


def _read_documents(files: list[pathlib.Path], max_bytes: int | None) -> list[bytes]:
    """Read text-looking files in order, stopping once `max_bytes` (plus separators) are read."""
    docs: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break  # enough data; don't read the rest of a large tree
        try:
            doc = path.read_bytes()
        except OSError as e:
            raise CorpusError(f"cannot read corpus file {path}: {e}") from e
        if not doc or b"\x00" in doc:
            continue  # empty, or binary-looking (text files never contain NUL bytes)
        docs.append(doc)
        total += len(doc) + 1  # + 1 for the b"\n" that will join it to the next document
    return docs


def load_corpus(
    source: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    *,
    min_bytes: int = 1,
) -> bytes:
    """Load the training corpus as one byte string.

    Args:
        source: None for the default standard-library corpus (`default_corpus_files`); a file
            path for that file's bytes; a directory for all regular files inside it (recursive,
            sorted by path, skipping hidden directories and binary-looking files, i.e. files that
            contain a NUL byte). Documents are joined with b"\\n".
        max_bytes: If given, the corpus is truncated to at most this many bytes (and files past
            that point are not even read).
        min_bytes: The smallest acceptable corpus size, so callers can fail early with a clear
            message instead of deep inside batching.

    Returns:
        The corpus bytes.

    Raises:
        CorpusError: If `source` does not exist, the corpus is empty (no usable files), or it is
            smaller than `min_bytes`; also for a non-positive `max_bytes`.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive, got {max_bytes}")

    if source is None:
        where = "the default standard-library corpus"
        docs = _read_documents(default_corpus_files(), max_bytes)
    else:
        path = pathlib.Path(source)
        where = str(path)
        if not path.exists():
            raise CorpusError(f"corpus path does not exist: {path}")
        if path.is_dir():
            docs = _read_documents(_walk_files(path), max_bytes)
        else:
            # An explicitly named file is taken as-is, even if it looks binary.
            try:
                docs = [path.read_bytes()]
            except OSError as e:
                raise CorpusError(f"cannot read corpus file {path}: {e}") from e

    data = b"\n".join(docs)
    if max_bytes is not None:
        data = data[:max_bytes]
    if not data:
        raise CorpusError(f"corpus is empty: {where} has no usable (non-binary, non-empty) files")
    if len(data) < min_bytes:
        raise CorpusError(f"corpus too small: {where} has {len(data)} bytes, need {min_bytes}")
    return data


# -------------------------------------------------------------------------------------------------
# Splits and shards


@dataclass(frozen=True, eq=False)  # eq=False: comparing numpy arrays with == is not a bool
class CorpusSplit:
    """The corpus cut into a training part and a held-out tail.

    Attributes:
        train: uint8 (N_train,) bytes used for training (sharded across learner units).
        heldout: uint8 (N_heldout,) bytes used only for evaluation.
    """

    train: np.ndarray
    heldout: np.ndarray


def split_corpus(data: bytes, heldout_fraction: float = 0.02) -> CorpusSplit:
    """Split the corpus into train and held-out parts, deterministically.

    The held-out part is the tail of the corpus. With the sorted default corpus that means whole
    files the model never trains on, so the held-out loss measures generalisation rather than
    memorisation of nearby windows.

    Args:
        data: The corpus, e.g. from `load_corpus`.
        heldout_fraction: Fraction of bytes, in (0, 1), that goes to the held-out tail. Both
            parts always get at least one byte.

    Returns:
        A `CorpusSplit` of read-only uint8 views into `data` (no copy).

    Raises:
        ValueError: If `heldout_fraction` is not in (0, 1).
        CorpusError: If `data` has fewer than 2 bytes.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(data) < 2:
        raise CorpusError(f"corpus too small to split: {len(data)} bytes")
    arr = np.frombuffer(data, dtype=np.uint8)  # read-only view of the bytes object
    n_heldout = min(max(1, round(len(arr) * heldout_fraction)), len(arr) - 1)
    cut = len(arr) - n_heldout
    return CorpusSplit(train=arr[:cut], heldout=arr[cut:])


def shard_for_unit(train: np.ndarray, unit: int, num_units: int) -> np.ndarray:
    """The slice of the training data owned by one learner unit.

    Shards are contiguous, pairwise disjoint, and together cover `train` exactly; their sizes
    differ by at most one byte. Each unit therefore trains on data no other unit sees, as in
    DiLoCo's non-i.i.d. setting.

    Args:
        train: uint8 (N,) training bytes.
        unit: Index of this unit, 0 <= unit < num_units.
        num_units: Total number of learner units.

    Returns:
        A view train[lo:hi] (no copy).

    Raises:
        ValueError: If `num_units` < 1 or `unit` is out of range.
        CorpusError: If `train` has fewer bytes than there are units.
    """
    if num_units < 1:
        raise ValueError(f"num_units must be >= 1, got {num_units}")
    if not 0 <= unit < num_units:
        raise ValueError(f"unit must be in [0, {num_units}), got {unit}")
    n = len(train)
    if n < num_units:
        raise CorpusError(f"training data ({n} bytes) is too small for {num_units} shards")
    lo, hi = n * unit // num_units, n * (unit + 1) // num_units
    return train[lo:hi]


# -------------------------------------------------------------------------------------------------
# Batches


def _windows(data: np.ndarray, window: int, what: str) -> np.ndarray:
    """All length-`window` windows of `data` as a zero-copy (N - window + 1, window) view."""
    if data.ndim != 1:
        raise ValueError(f"{what} must be a 1-D byte array, got shape {data.shape}")
    if len(data) < window:
        raise CorpusError(f"{what} has {len(data)} bytes, fewer than one window of {window}")
    return np.lib.stride_tricks.sliding_window_view(data, window)


class BatchSampler:
    """Random training windows from one unit's shard, reproducible from (seed, unit, step).

    There is no hidden RNG state: `batch(step)` seeds a fresh generator from (seed, unit, step),
    so a unit restarted at step k gets exactly the batches it would have seen, and units with the
    same seed still draw independent window positions.
    """

    def __init__(self, shard: np.ndarray, seq_len: int, batch_size: int, seed: int, unit: int):
        """Prepare the sampler.

        Args:
            shard: uint8 (N,) bytes of this unit's shard (from `shard_for_unit`).
            seq_len: Model context length T; windows have T + 1 bytes (inputs plus targets).
            batch_size: Windows per batch, B.
            seed: Run-wide seed, >= 0.
            unit: This unit's index, >= 0; mixed into the seed.

        Raises:
            ValueError: For a non-positive `seq_len`/`batch_size` or a negative `seed`/`unit`.
            CorpusError: If the shard is shorter than one window (seq_len + 1 bytes).
        """
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if seed < 0 or unit < 0:
            raise ValueError(f"seed and unit must be >= 0, got {seed}, {unit}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.unit = unit
        self._windows = _windows(shard, seq_len + 1, f"shard of unit {unit}")  # (W, T + 1)

    def batch(self, step: int) -> np.ndarray:
        """The batch for one training step.

        Args:
            step: Training step, >= 0.

        Returns:
            int32 (batch_size, seq_len + 1): windows starting at uniformly random offsets of the
            shard (drawn with replacement). A pure function of (seed, unit, step).

        Raises:
            ValueError: If `step` is negative.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, self.unit, step])
        starts = rng.integers(0, len(self._windows), size=self.batch_size)  # (B,)
        return self._windows[starts].astype(np.int32)  # fancy indexing copies: (B, T + 1)


def eval_batches(
    heldout: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> np.ndarray:
    """A fixed evaluation set: evenly spaced windows spanning the held-out data.

    Args:
        heldout: uint8 (N,) held-out bytes.
        seq_len: Model context length T; windows have T + 1 bytes.
        batch_size: Windows per batch, B.
        num_batches: Number of batches, NB.

    Returns:
        int32 (num_batches, batch_size, seq_len + 1). The first window starts at offset 0 and the
        last one ends at the final byte; windows overlap only if the held-out data is shorter
        than num_batches * batch_size windows. Same inputs, same array.

    Raises:
        ValueError: For non-positive sizes.
        CorpusError: If the held-out data is shorter than one window.
    """
    if min(seq_len, batch_size, num_batches) < 1:
        raise ValueError(
            f"seq_len, batch_size, num_batches must be >= 1, got {seq_len}, {batch_size}, "
            f"{num_batches}"
        )
    windows = _windows(heldout, seq_len + 1, "held-out data")  # (W, T + 1)
    n = num_batches * batch_size
    starts = np.linspace(0, len(windows) - 1, n).round().astype(np.int64)  # (NB * B,)
    return windows[starts].astype(np.int32).reshape(num_batches, batch_size, seq_len + 1)
