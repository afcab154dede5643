"""The cross-encoder's ONNX runtime: the model's ONNX file on onnxruntime's CPU provider.

What ``CrossEncoder.predict`` does, with the model swapped for an
:class:`onnxruntime.InferenceSession`: the model folder's own tokenizer
(``AutoTokenizer``) encodes each batch of pairs, padded only to the batch's longest
pair and truncated ``longest_first`` at ``max_length`` (at most the model's
``max_position_embeddings``), exactly as ``CrossEncoder(model, max_length=...)``
tokenizes; the session returns the raw logits, which
:func:`memory.rerank.cross_encoder.relevance` maps to [0, 1].

The file is ``onnx_file`` inside the model's folder (or hub repo): ``onnx/model.onnx``
by default, or an int8 one (``onnx/model_qint8_avx512_vnni.onnx``, the layout HF
cross-encoder repos ship and ``bot.py export-onnx --int8`` writes).

Session options, measured on a 2-core Xeon (BENCHMARKS.md, issue 23):

* ``SkipLayerNormFusion`` is turned off.  onnxruntime fuses each residual ``Add`` +
  ``LayerNormalization`` into one ``SkipLayerNormalization`` kernel, which took
  54 ms of an int8 MiniLM-L6's 233 ms for 30 pairs, against 16 ms for the two
  unfused kernels: the fusion made the model about a fifth slower (15-20 % of CPU
  time in later runs, whether the session or onnxruntime's offline transformer
  optimizer fuses it).
* ``intra_op.allow_spinning`` off: a worker thread waiting for work sleeps instead of
  spinning.  With other processes busy on the two cores (load average 5), spinning
  made an int8 call 1.6-1.8x slower (0.50-0.57 s against 0.31-0.33 s, and half as much
  CPU again); on an idle machine it was about 9 % faster.  A bot's cores are shared
  with its event loop, the embedder and SQLite, so the reranker does not spin.
* Full graph optimisation (the default, said explicitly), onnxruntime's default
  thread count (one per physical core) and sequential execution.  Setting these
  explicitly, one thread, ``ORT_ENABLE_EXTENDED`` or ``session.dynamic_block_base``
  measured the same within the noise of a shared machine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memory.config import CrossEncoderConfig
from memory.errors import RerankerUnavailable
from memory.rerank.base import check_classifier

if TYPE_CHECKING:
    from numpy.typing import NDArray

log = logging.getLogger(__name__)

DEFAULT_ONNX_FILE = "onnx/model.onnx"
# Graph fusions that made cross-encoders slower on the CPU (see the module).
SLOW_FUSIONS = ("SkipLayerNormFusion",)
# ONNX input element types and the numpy type each is fed as.
_INPUT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


class OnnxCrossEncoder:
    """A cross-encoder's ONNX file on onnxruntime, returning logits.

    Args:
        session: The model's ``InferenceSession``.
        tokenizer: The model folder's tokenizer.
        max_length: Tokens per pair at most.
        labels: Outputs per pair.
    """

    device = "cpu"

    def __init__(self, session: Any, tokenizer: Any, max_length: int, labels: int) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.labels = labels
        self._inputs = {i.name: _INPUT_TYPES.get(i.type, np.int64) for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        self._output = "logits" if "logits" in outputs else outputs[0]

    @classmethod
    def load(cls, config: CrossEncoderConfig) -> OnnxCrossEncoder:
        """Open ``config.onnx_file`` of ``config.model`` with its tokenizer.

        Raises:
            RerankerUnavailable: onnxruntime is missing, the file is missing or not
                ONNX, it does not take a tokenizer's inputs, or the model's config
                is not a sequence classifier (each in one line).
        """
        try:
            import onnxruntime  # noqa: F401  (said here, before the model's files are read)
        except ImportError as exc:
            raise RerankerUnavailable(
                f"runtime = \"onnx\" needs onnxruntime ({exc}); install the bot's [onnx] extra "
                "(pip install '.[onnx]' in the repository) or use runtime = \"torch\""
            ) from None
        path = model_file(config.model, config.onnx_file or DEFAULT_ONNX_FILE)
        tokenizer, model_config = _tokenizer_and_config(config.model)
        check_classifier(getattr(model_config, "architectures", None), config.model)
        session = open_session(path)
        _check_inputs(session, tokenizer, path)
        positions = getattr(model_config, "max_position_embeddings", None) or config.max_length
        return cls(session, tokenizer, min(config.max_length, positions),
                   int(model_config.num_labels))

    def logits(self, pairs: Sequence[tuple[str, str]]) -> NDArray[np.float32]:
        """Raw logits for one batch, shape ``(len(pairs), labels)``.

        Raises:
            RuntimeError: onnxruntime failed (the backend turns it into a RerankerError).
        """
        encoded = self.tokenizer(
            [q for q, _ in pairs], [d for _, d in pairs], padding=True,
            truncation="longest_first", max_length=self.max_length, return_tensors="np",
        )
        feed = {name: np.asarray(encoded[name], dtype=kind) for name, kind in self._inputs.items()}
        try:
            (logits,) = self.session.run([self._output], feed)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise RuntimeError(f"onnxruntime: {exc}") from exc
        return np.asarray(logits, dtype=np.float32).reshape(len(pairs), -1)

    def close(self) -> None:
        """Drop the session (onnxruntime frees it with the last reference)."""
        self.session = None


def model_file(model: str, name: str) -> Path:
    """The path of file ``name`` of ``model``: in its folder, or fetched from its hub repo.

    Raises:
        RerankerUnavailable: The folder has no such file, or the hub repo has none
            (or cannot be reached).
    """
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / name
        if not path.is_file():
            raise RerankerUnavailable(
                f"no ONNX file {name} in {folder}: make one with `bot.py export-onnx {folder}` "
                "(--int8 for the quantised copy) or set reranker.onnx_file to one the folder has"
            )
        return path
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model, name))
    except Exception as exc:  # huggingface_hub's errors: missing repo or file, offline, network
        raise RerankerUnavailable(
            f"cannot get {name} of {model!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "give a local folder or an onnx_file the repo has (e.g. onnx/model_qint8_avx512_vnni.onnx)"
        ) from None


def open_session(path: Path) -> Any:
    """An ``InferenceSession`` for ``path`` on the CPU, with the options of the module.

    Raises:
        RerankerUnavailable: onnxruntime cannot read the file.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=list(SLOW_FUSIONS))
    except Exception as exc:  # onnxruntime's own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RerankerUnavailable(f"onnxruntime cannot load {path}: {first[:300]}") from None


def _tokenizer_and_config(model: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RerankerUnavailable(
            f"cross-encoder {model!r}: its tokenizer or config.json cannot be read "
            f"({type(exc).__name__}: {first[:200]}); the ONNX runtime reads them from the "
            "model's folder"
        ) from None


def _check_inputs(session: Any, tokenizer: Any, path: Path) -> None:
    """Refuse a file whose inputs the tokenizer does not produce, in one line.

    Raises:
        RerankerUnavailable: An input is not one of the tokenizer's.
    """
    wanted = [i.name for i in session.get_inputs()]
    produced = list(tokenizer.model_input_names)
    unknown = [name for name in wanted if name not in produced]
    if unknown:
        raise RerankerUnavailable(
            f"{path} takes input(s) {', '.join(unknown)} that the model's tokenizer does not "
            f"give (it gives {', '.join(produced)}): export the model with the tokenizer's "
            "names (bot.py export-onnx)"
        )
