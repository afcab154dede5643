"""``bot.py export-onnx MODEL_DIR [--int8]``: a cross-encoder's ONNX files for ``runtime = "onnx"``.

Writes ``MODEL_DIR/onnx/model.onnx`` with torch's ONNX exporter (``torch.onnx.export``,
``dynamo=True``: the TorchScript exporter is deprecated since torch 2.9) and, with
``--int8``, a dynamically quantised copy made with onnxruntime's
``quantize_dynamic``, named the way Hugging Face cross-encoder repos name theirs
(``onnx/model_qint8_avx512_vnni.onnx`` on a CPU with VNNI).  Both are checked
against the torch model on a few pairs before the command says where they are.

The model is exported with the plain ("eager") attention: torch's fused attention
exports as extra masking operators (``Where``, ``IsNaN`` on every head) that cost
onnxruntime about 8 % of a MiniLM-L6's time (BENCHMARKS.md, issue 23).

Int8: weights ``QInt8`` with one scale per output channel, activations quantised per
batch.  Measured on MiniLM-L6 (BENCHMARKS.md, issue 23): per-channel scales cost no
time against one scale per tensor and halve the largest score error (0.0017 against
0.0033); ``QUInt8`` weights are twice as slow; quantising only the ``MatMul`` nodes
(embeddings left float32) or ``reduce_range`` is no faster; a graph pre-fused by
onnxruntime's transformer optimizer (``Attention``/``QAttention``, ``SkipLayerNormalization``)
is slower.  On an x86 CPU without VNNI the weights use 7 bits (``reduce_range``), which
that instruction set needs to avoid overflow (onnxruntime's quantisation guide).
"""

from __future__ import annotations

import logging
import platform
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.errors import ConfigError, RerankerUnavailable
from memory.rerank.base import check_classifier
from memory.rerank.cross_encoder import relevance

log = logging.getLogger(__name__)

F32_FILE = "onnx/model.onnx"
# What the export must agree with torch to: float32 on both sides, other kernels.
F32_TOLERANCE = 1e-3
CHECK_PAIRS = [
    ("when is the raid on saturday", "the raid moved to 9pm, bring potions"),
    ("who can lend me a soldering iron", "I have one, ping me"),
    ("what did we decide about the server rules", "no spoilers in general, use the spoiler channel"),
    ("pizza", ""),
]


@dataclass(frozen=True)
class Exported:
    """What :func:`export_cross_encoder` wrote.

    Attributes:
        folder: The model's folder.
        files: The files written, relative to ``folder`` (float32 first).
        max_diff: Largest difference of each file's scores from torch's, in [0, 1].
    """

    folder: Path
    files: tuple[str, ...]
    max_diff: tuple[float, ...]


def int8_flavour() -> tuple[str, bool]:
    """The int8 file's flavour for this CPU and whether its weights need ``reduce_range``.

    Returns:
        ``("avx512_vnni", False)``, ``("arm64", False)``, ``("avx512", True)`` or
        ``("avx2", True)``: the suffix HF cross-encoder repos use, and whether the
        weights are quantised to 7 bits (x86 without VNNI).
    """
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64", False
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split()
    except OSError:
        flags = []
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        return "avx512_vnni", False
    return ("avx512" if "avx512f" in flags else "avx2"), True


def int8_file() -> str:
    """The int8 file's name for this CPU, inside a model's folder."""
    return f"onnx/model_qint8_{int8_flavour()[0]}.onnx"


def export_cross_encoder(folder: Path, *, int8: bool = False) -> Exported:
    """Export the cross-encoder in ``folder`` to ONNX (and an int8 copy), checked against torch.

    Raises:
        ConfigError: ``folder`` is not a sequence-classification model with a
            trained head and a tokenizer, the ONNX packages are missing, a file cannot be written
            (``onnx`` is a file, the folder is read-only), the export or the
            quantisation fails, or an exported file disagrees with torch.
    """
    model, tokenizer = _load(folder)
    names = [n for n in tokenizer.model_input_names if n != "position_ids"]
    expected = _torch_scores(model, tokenizer, names)
    target = folder / F32_FILE
    with _failing_as_config_error(f"exporting {folder} to {target}"):
        target.parent.mkdir(parents=True, exist_ok=True)
        _export(model, tokenizer, names, target)
    files, diffs = [F32_FILE], [_check(target, tokenizer, expected, F32_TOLERANCE)]
    if int8:
        name = int8_file()
        with _failing_as_config_error(f"quantising {target} to {folder / name}"):
            quantize_int8(target, folder / name)
        files.append(name)
        diffs.append(_check(folder / name, tokenizer, expected, None))
    return Exported(folder, tuple(files), tuple(diffs))


def quantize_int8(source: Path, target: Path) -> None:
    """Dynamically quantise ``source`` to int8 for this CPU (see the module)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _, reduce_range = int8_flavour()
    with _dropped(logging.getLogger(), "Please consider to run pre-processing"):
        # its shape pre-processing fails on torch's dynamo exports ("Incomplete symbolic
        # shape inference") and dynamic quantisation does not need it
        quantize_dynamic(source, target, weight_type=QuantType.QInt8, per_channel=True,
                         reduce_range=reduce_range)


@contextmanager
def _failing_as_config_error(doing: str) -> Iterator[None]:
    """Turn any failure inside the block into one line saying what was being done.

    torch's exporter and onnxruntime's quantiser fail with many exception types
    (OSError for a file in the way or a read-only folder, their own export errors);
    the full traceback is kept at DEBUG.
    """
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        log.debug("%s failed", doing, exc_info=True)
        raise ConfigError(f"{doing} failed: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    """``exc``'s type and the first line of its message, at most 200 characters."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


@contextmanager
def _dropped(logger: logging.Logger, prefix: str) -> Iterator[None]:
    """Drop ``logger``'s records that start with ``prefix`` inside the block."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _load(folder: Path) -> tuple[Any, Any]:
    try:
        import onnx  # noqa: F401  (onnxruntime's quantiser reads and writes with it)
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  (torch.onnx.export(dynamo=True) builds with it)
        import torch  # noqa: F401
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as exc:
        raise ConfigError(f"export-onnx needs torch and the [onnx] extra (onnxruntime, onnx, "
                          f"onnxscript; {exc}): pip install '.[onnx]' in the repository") from None
    try:
        # a plain encoder is refused before its weights load (and transformers
        # reports the random head it would add)
        _check_classifier(AutoConfig.from_pretrained(folder).architectures, folder)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            folder, attn_implementation="eager", output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{folder} is not a cross-encoder folder with a tokenizer "
                          f"({first[:200]})") from None
    # else the check would compare a random head's scores with themselves
    _check_classifier(model.config.architectures, folder, info["missing_keys"])
    return model.eval(), tokenizer


def _check_classifier(architectures: Any, folder: Path, missing: Any = ()) -> None:
    """:func:`~memory.rerank.base.check_classifier`'s refusal as a ConfigError."""
    try:
        check_classifier(architectures, str(folder), missing)
    except RerankerUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _encode(tokenizer: Any, names: list[str], tensors: str) -> dict[str, Any]:
    encoded = tokenizer([q for q, _ in CHECK_PAIRS], [d for _, d in CHECK_PAIRS], padding=True,
                        truncation="longest_first", return_tensors=tensors)
    return {name: encoded[name] for name in names}


def _torch_scores(model: Any, tokenizer: Any, names: list[str]) -> list[float]:
    import torch

    with torch.inference_mode():
        return relevance(model(**_encode(tokenizer, names, "pt")).logits.float().numpy())


def _export(model: Any, tokenizer: Any, names: list[str], target: Path) -> None:
    import torch

    sample = _encode(tokenizer, names, "pt")
    with warnings.catch_warnings():
        # torch.export's own pytree code still calls the LeafSpec check it deprecated:
        # torch's call, not ours, and nothing an exporter can change
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                category=FutureWarning)
        # every input shares the batch and sequence axes, which the exporter notes once
        # per input and axis; the file's axes are named as asked all the same
        warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
        program = torch.onnx.export(
            model, (), kwargs=sample, input_names=names, output_names=["logits"],
            dynamic_shapes={name: {0: "batch", 1: "sequence"} for name in names}, dynamo=True,
            verbose=False,
        )
        if program is None:  # only the TorchScript exporter returns nothing
            raise ConfigError("torch.onnx.export returned no program")
        program.save(str(target))
    log.info("exported %s", target)


def _check(path: Path, tokenizer: Any, expected: list[float], tolerance: float | None) -> float:
    """The file's largest score difference from torch's (refused above ``tolerance``).

    Raises:
        ConfigError: The difference is above ``tolerance``.
    """
    from memory.rerank.onnx_runtime import open_session

    session = open_session(path)
    feed = {i.name: _encode(tokenizer, [i.name], "np")[i.name].astype("int64")
            for i in session.get_inputs()}
    logits = session.run(None, feed)[0]
    diff = max(abs(a - b) for a, b in zip(relevance(logits), expected, strict=True))
    if tolerance is not None and diff > tolerance:
        raise ConfigError(f"{path} disagrees with the torch model by {diff:.2g} "
                          f"(more than {tolerance:g}): the export is not usable")
    return diff
