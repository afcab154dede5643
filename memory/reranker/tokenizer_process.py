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
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

LOAD_TIMEOUT_S = 600.0  # a child that neither answers nor exits by then is killed


class TokenizerProcess:
    """The subset of a fast tokenizer the reranker uses, answered by a child process.

    Args:
        name: A folder or hub id, as for ``AutoTokenizer.from_pretrained``.

    Raises:
        OSError: The child could not load the tokenizer (the message says why).
    """

    def __init__(self, name: str) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of torch's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, name), daemon=True,
                                        name="reranker-tokenizer")
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        if not self._conn.poll(LOAD_TIMEOUT_S):
            self.close()
            raise OSError(f"the tokenizer of {name!r} did not load within {LOAD_TIMEOUT_S:g} s")
        attributes = self._reply()
        self.pad_token_id: int | None = attributes["pad_token_id"]
        self.unk_token_id: int | None = attributes["unk_token_id"]

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True
    ) -> dict[str, Any]:
        """Tokenize one text or a list of texts; ``{"input_ids": ...}`` as the tokenizer's."""
        one = isinstance(text, str)
        ids = self._ask("encode", [text] if one else list(text), add_special_tokens)
        return {"input_ids": ids[0] if one else ids}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one vocabulary token (``unk_token_id`` or ``None`` if absent)."""
        return self._ask("token_id", token)

    def close(self) -> None:
        """Stop the child process (it also stops when this object is collected)."""
        self._conn.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            self._conn.send(request)
            return self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise OSError(f"the tokenizer process ended ({exc!r})") from exc
        if status == "error":
            raise OSError(value)
        return value


def _serve(conn: Connection, name: str) -> None:
    """The child: load the tokenizer, then answer requests until the pipe closes."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # the parent raises it as an OSError with this text
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", {"pad_token_id": tokenizer.pad_token_id,
                      "unk_token_id": tokenizer.unk_token_id}))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if request[0] == "encode":
                value: Any = tokenizer(request[1], add_special_tokens=request[2])["input_ids"]
            else:
                value = tokenizer.convert_tokens_to_ids(request[1])
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", value))
