"""The official Qwen3-Reranker prompt, shared by every backend.

The model was trained on exactly this chat layout, so the text here must not drift:
a fixed system message, a user turn holding the instruction, query and document, and
an assistant turn opened with an empty think block.  The model's next token is then
"yes" or "no", and the relevance score is P(yes) over those two tokens.
"""

from __future__ import annotations

# re-exported: the profile (memory.config) owns the default instruction
from memory.config import DEFAULT_INSTRUCTION as DEFAULT_INSTRUCTION

SYSTEM_PROMPT = (
    "Judge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".'
)

# The pre-tokenizer split pattern of Qwen2/Qwen3's tokenizer.json; :func:`head_text`
# relies on it never joining ``:`` with a following space.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def user_turn(instruction: str, query: str, document: str) -> str:
    """Return the user turn of the official prompt.

    Args:
        instruction: What relevance means for this application.
        query: The search query.
        document: The candidate text to judge.

    Returns:
        ``"<Instruct>: ...\\n<Query>: ...\\n<Document>: ..."``.
    """
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def full_prompt(instruction: str, query: str, document: str) -> str:
    """Return the whole prompt text as the official reference implementation builds it."""
    return PREFIX + user_turn(instruction, query, document) + SUFFIX


def head_text(instruction: str, query: str) -> str:
    """Return the part of the prompt shared by every document of one query.

    It stops right after ``<Document>:`` so that the document piece starts with the
    space.  Qwen's pre-tokenizer always splits between ``:`` and a following space, so
    tokenizing head and ``" " + document`` separately yields the same ids as
    tokenizing the joined text; that is what makes the shared-prefix KV cache exact.
    """
    return PREFIX + f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>:"


def document_text(document: str) -> str:
    """Return the document piece that follows :func:`head_text`."""
    return " " + document


def chat_messages(instruction: str, query: str, document: str) -> list[dict[str, str]]:
    """Return the prompt as OpenAI-style chat messages: the system and user turns.

    The assistant turn is not pre-filled: under Qwen3's chat template, with
    ``enable_thinking: false``, llama-server opens it with the empty think block
    itself, so a pre-filled block would appear twice.
    """
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_turn(instruction, query, document)},
    ]
