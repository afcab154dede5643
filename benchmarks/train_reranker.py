"""``bench train-reranker``: a cross-encoder fine-tuned on labelled sets, to measure reranking.

No trained reranker can be downloaded on these machines, so the rerank stage was only
ever run with random weights.  This makes a stand-in: the bundled all-MiniLM-L6-v2
encoder with a fresh one-logit head, fine-tuned as a cross-encoder on the questions of
the given sets.  Each question's evidence messages are its positives; its hard
negatives are what the project's own hybrid search ranks highest among the messages
that are *not* evidence (the mistakes a reranker is there to fix), so the model learns
the decision the rerank stage actually faces.  Pairs are ``(question,
StoredMessage.rerank_text)``, the text the searcher gives a reranker.

Training uses sentence-transformers' ``CrossEncoder`` and its documented
``BinaryCrossEntropyLoss`` (the loss its MS MARCO rerankers were trained with) in a
plain torch loop: AdamW, linear warm-up and decay, as ``CrossEncoderTrainer`` would
run it.  The trainer itself (and ``CrossEncoder.fit``, which wraps it) needs the
``datasets`` package with pyarrow and pandas, which the locked environment does not
carry, and the older ``CrossEncoder.old_fit`` is deprecated (it reads properties its
own library deprecates); the loss's ``forward(inputs, labels)`` is the same public
call the trainer makes.

Everything is seeded (Python, NumPy, torch, the negatives' sampling and the batches'
order), so two runs with the same thread count give the same weights.  The folder
written is a normal Hugging Face cross-encoder folder: ``backend = "cross-encoder"``,
``model = FOLDER`` in any profile.  The sets' licences (CC BY-NC, transcripts whose
rights belong to others) do not allow redistributing a model trained on them, so it
is refused a place inside this repository and the output says so.

Some seeds collapse: the model ends up scoring every pair about alike (two of 20 fold
models in BENCHMARKS.md, issue 32's fourth and fifth rounds).  After training, the
model scores a seeded sample of its own pairs (:func:`check_training`); the spread and
AUC go into ``training.json`` and the report, and the command fails when they show a
collapse, so nobody blends a flat model into their searches unawares.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import scratch_location
from cli.scoring import Query, load_queries
from memory.config import Profile
from memory.embedder import BUNDLED_MODEL_ID, Embedder, resolve_model
from memory.engine import MemoryEngine
from memory.errors import ConfigError
from memory.records import StoredMessage
from memory.search import SearchRequest

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
LICENCE_NOTICE = (
    "This model was trained on the questions and messages of the datasets named in "
    "training.json. Their licences (LoCoMo: CC BY-NC 4.0; FriendsQA: transcripts owned "
    "by the show's rights holders; Molweni: Ubuntu IRC logs) do not allow redistributing "
    "it: keep it on this machine for measurement, never commit, upload or share it."
)
NOTICE_FILE = "NOT-FOR-REDISTRIBUTION.txt"
# the trained model's scores on its own pairs: below this standard deviation, or this
# AUC, it collapsed (healthy seeds: ~0.21 and ~0.85; collapsed ones: 0.007-0.067 and ~0.65)
COLLAPSED_SPREAD = 0.05
COLLAPSED_AUC = 0.75
CHECK_PAIRS = 1000

Progress = Callable[[int], None]


@dataclass(frozen=True)
class TrainingSettings:
    """How the stand-in is trained.

    Attributes:
        base: The encoder to start from (a sentence-transformers or Hugging Face folder
            or id); the bundled MiniLM by default.
        negatives: Hard negatives per question, drawn from the hybrid head.
        easy_negatives: Easy negatives per question: other questions' evidence in the
            same set (hard negatives alone left the model at the base rate).
        pool: How deep in the hybrid order negatives are drawn from (the rerank head).
        epochs: Passes over the pairs.
        batch_size: Pairs per step.
        learning_rate: AdamW's peak learning rate (linear warm-up over 10 % of steps).
        max_length: Tokens per (question, message) pair.
        seed: Seeds Python, NumPy, torch, the sampling and the batch order.
        holdout_channels: Questions whose evidence is in these channels are not trained
            on (a cross-validation fold: train on the rest, score on these).
    """

    base: str = BUNDLED_MODEL_ID
    negatives: int = 4
    easy_negatives: int = 2
    pool: int = 30
    epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 1e-4
    max_length: int = 128
    seed: int = 12
    holdout_channels: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class TrainingPair:
    """One labelled (question, message) pair: 1.0 evidence, 0.0 a hard negative."""

    query: str
    text: str
    label: float


def check_output_folder(out: Path) -> Path:
    """The resolved folder to write the model to, if it may be written there.

    Raises:
        ConfigError: ``out`` is inside this repository (a model trained on licensed
            sets must not be committed), or it is a file or a non-empty folder.
    """
    target = out.expanduser().resolve()
    if target == REPO_ROOT or REPO_ROOT in target.parents:
        raise ConfigError(
            f"{out}: inside the repository ({REPO_ROOT}); a model trained on these sets must "
            "not be committed or redistributed: give a folder outside it, e.g. /work/models/ce1"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; give a new folder")
    return target


def mine_pairs(
    datasets: Sequence[str | Path], profile: Profile, embedder: Embedder,
    settings: TrainingSettings, progress: Progress | None = None,
) -> list[TrainingPair]:
    """Every question's evidence and hard negatives from the hybrid search, all sets.

    Each set is imported into a throw-away SQLite database and every question searched
    guild-wide without reranking (``settings.pool`` hits); up to ``settings.negatives``
    non-evidence hits are drawn from them at random (seeded).

    Raises:
        ImportFormatError: A set or its queries file is missing or malformed.
    """
    rng = random.Random(settings.seed)
    pairs: list[TrainingPair] = []
    for data in datasets:
        queries = [q for q in load_queries(Path(data) / "queries.jsonl")
                   if q.channel_id not in settings.holdout_channels]
        with scratch_location() as location:
            engine = MemoryEngine(location, profile, embedder, load_reranker=False)
            try:
                engine.import_exports([data])
                evidence = engine.storage.messages.hydrate(
                    sorted({i for q in queries for i in q.relevant}))
                for query in queries:
                    pairs += _query_pairs(engine, query, evidence, settings, rng)
                    if progress:
                        progress(1)
            finally:
                engine.close()
    return pairs


def _query_pairs(
    engine: MemoryEngine, query: Query, evidence: dict[int, StoredMessage],
    settings: TrainingSettings, rng: random.Random,
) -> list[TrainingPair]:
    """One question's positives (its evidence), hard negatives (hybrid's wrong hits) and
    easy negatives (other questions' evidence in the same set)."""
    result = engine.search(SearchRequest(
        queries=(query.text,), guild_id=query.guild_id, limit=settings.pool, mode="hybrid",
        rerank=False))
    wrong = [h.rerank_text for h in result.hits if h.id not in query.relevant]
    hard = rng.sample(wrong, min(settings.negatives, len(wrong)))
    others = [m.rerank_text for i, m in evidence.items() if i not in query.relevant]
    easy = rng.sample(others, min(settings.easy_negatives, len(others)))
    return ([TrainingPair(query.text, evidence[i].rerank_text, 1.0)
             for i in sorted(query.relevant) if i in evidence]
            + [TrainingPair(query.text, text, 0.0) for text in hard + easy])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the head's initialisation and the dropout)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_cross_encoder(
    pairs: Sequence[TrainingPair], out: Path, settings: TrainingSettings,
    show_progress_bar: bool = True,
) -> Path:
    """Fine-tune ``settings.base`` as a one-logit cross-encoder on ``pairs``; save to ``out``.

    Binary cross-entropy on the logit (sentence-transformers' ``BinaryCrossEntropyLoss``,
    as its MS MARCO rerankers were trained), AdamW with a linear warm-up over the first
    10 % of the steps and linear decay after, gradients clipped at 1.

    Returns:
        ``out``, a folder ``CrossEncoder(out)`` (and a profile's ``model``) loads.

    Raises:
        ConfigError: No pairs to train on.
    """
    if not pairs:
        raise ConfigError("no training pairs: the sets have no questions with evidence")
    import torch
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from tqdm import tqdm
    from transformers import get_linear_schedule_with_warmup

    seed_everything(settings.seed)
    _, base = resolve_model(settings.base)
    model = CrossEncoder(base, num_labels=1, max_length=settings.max_length, device="cpu")
    positives = sum(1 for p in pairs if p.label > 0.5)
    # weigh positives as much as all negatives together, so the base rate is no minimum
    balance = torch.tensor((len(pairs) - positives) / max(1, positives))
    loss = BinaryCrossEntropyLoss(model, pos_weight=balance)
    batches = _batches(pairs, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
    schedule = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, len(batches) // 10), num_training_steps=len(batches))
    model.train()
    for batch in tqdm(batches, desc="training", unit="step", disable=not show_progress_bar):
        value = loss([[p.query for p in batch], [p.text for p in batch]],
                     torch.tensor([p.label for p in batch]))
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out


def _batches(pairs: Sequence[TrainingPair], settings: TrainingSettings
             ) -> list[list[TrainingPair]]:
    """Every epoch's pairs shuffled (seeded) and cut into batches."""
    rng = random.Random(settings.seed)
    batches = []
    for _ in range(settings.epochs):
        order = list(pairs)
        rng.shuffle(order)
        batches += [order[i:i + settings.batch_size]
                    for i in range(0, len(order), settings.batch_size)]
    return batches


@dataclass(frozen=True)
class TrainingCheck:
    """How the trained model separates a seeded sample of its own training pairs.

    A healthy stand-in's scores spread widely over them (standard deviation ~0.21, AUC
    ~0.85 for the fold models in BENCHMARKS.md, issue 32 fifth round); the two that
    collapsed there score every pair about alike (spread 0.007, AUC 0.65) or rank them
    little better than chance (spread 0.067, AUC 0.66), so as a reranker they only add
    noise to the blend.

    Attributes:
        pairs: How many pairs were scored.
        auc: The chance a positive outscores a negative (ties count half); ``None``
            without both labels in the sample.
        spread: The standard deviation of the scores (probabilities, 0–1).
    """

    pairs: int
    auc: float | None
    spread: float

    @property
    def collapsed(self) -> bool:
        """Whether the scores barely vary or barely rank positives first."""
        return self.spread < COLLAPSED_SPREAD or (self.auc is not None and self.auc < COLLAPSED_AUC)

    @classmethod
    def of(cls, scores: Sequence[float], labels: Sequence[float]) -> TrainingCheck:
        """The check from each pair's score and label."""
        import numpy as np

        values, positive = np.asarray(scores, dtype=float), np.asarray(labels) > 0.5
        pos, neg = values[positive], values[~positive]
        auc = None
        if len(pos) and len(neg):
            auc = float((pos[:, None] > neg[None, :]).mean()
                        + 0.5 * (pos[:, None] == neg[None, :]).mean())
        return cls(len(values), auc, float(values.std()) if len(values) else 0.0)

    def record(self) -> dict[str, Any]:
        """The check as ``training.json`` and the command's report hold it."""
        return {"pairs": self.pairs, "auc": None if self.auc is None else round(self.auc, 3),
                "spread": round(self.spread, 3), "collapsed": self.collapsed}


def check_training(folder: Path, pairs: Sequence[TrainingPair], seed: int) -> TrainingCheck:
    """Score up to :data:`CHECK_PAIRS` of the training pairs (a seeded sample) with the
    model saved in ``folder``."""
    from sentence_transformers import CrossEncoder

    sample = random.Random(seed).sample(list(pairs), min(CHECK_PAIRS, len(pairs)))
    model = CrossEncoder(str(folder), device="cpu")
    scores = model.predict([(p.query, p.text) for p in sample], batch_size=32,
                           show_progress_bar=False)
    return TrainingCheck.of([float(s) for s in scores], [p.label for p in sample])


def write_notes(out: Path, datasets: Sequence[str | Path], pairs: Sequence[TrainingPair],
                settings: TrainingSettings, check: TrainingCheck) -> None:
    """The licence notice, what the model was trained on and a profile that uses it."""
    (out / NOTICE_FILE).write_text(LICENCE_NOTICE + "\n", encoding="utf-8")
    record: dict[str, Any] = {
        "datasets": [Path(d).name for d in datasets],
        "pairs": len(pairs),
        "positives": sum(1 for p in pairs if p.label > 0.5),
        "settings": {**vars(settings), "holdout_channels": sorted(settings.holdout_channels)},
        "check": check.record(),
        "notice": LICENCE_NOTICE,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (out / "profile.toml").write_text(profile_text(out), encoding="utf-8")


def profile_text(out: Path) -> str:
    """A profile that reranks with the model in ``out`` (``--profile out/profile.toml``)."""
    return (
        "# Written by `bench train-reranker`: the trained stand-in reranker. Not for "
        "redistribution.\n"
        "[embedder]\nmodel = \"all-MiniLM-L6-v2\"\ndevice = \"cpu\"\n\n"
        "[reranker]\nbackend = \"cross-encoder\"\n"
        f"model = {json.dumps(str(out))}\n"
        "device = \"cpu\"\nruntime = \"torch\"\nbatch_size = 16\nmax_length = 128\n"
        "oversample = 2\nmax_candidates = 30\ntimeout = 10.0\n"
        "# the stand-in is weaker than retrieval alone on some sets: blend, and let a\n"
        "# candidate from past retrieval's page in only when clearly better (BENCHMARKS.md,\n"
        "# issue 32 third round)\n"
        "blend = true\nblend_weight = 0.7\nkeep_margin = 0.2\n"
    )


def run_train_reranker(
    datasets: Sequence[str | Path], out: Path, profile: Profile, embedder: Embedder,
    settings: TrainingSettings, progress: Progress | None = None,
    on_mined: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Mine pairs on ``datasets``, train, and write the model and its notes to ``out``.

    ``on_mined`` runs between mining and training (the CLI saves its vector cache
    there, so an interrupted training does not cost the embedding again).

    Returns:
        ``{"out", "datasets", "pairs", "positives", "notice", "profile", "check"}``
        (``check``: :meth:`TrainingCheck.record`; a collapsed model is still written,
        and the caller says so).

    Raises:
        ConfigError: ``out`` may not be written (see :func:`check_output_folder`).
        ImportFormatError: A set is missing or malformed.
    """
    target = check_output_folder(out)
    pairs = mine_pairs(datasets, profile, embedder, settings, progress)
    if on_mined:
        on_mined()
    log.info("training on %d pairs from %d sets", len(pairs), len(datasets))
    train_cross_encoder(pairs, target, settings, show_progress_bar=progress is not None)
    check = check_training(target, pairs, settings.seed)
    log.info("trained model on %d of its pairs: AUC %s, score spread %.3f",
             check.pairs, check.auc, check.spread)
    write_notes(target, datasets, pairs, settings, check)
    return {
        "out": str(target), "datasets": [Path(d).name for d in datasets], "pairs": len(pairs),
        "positives": sum(1 for p in pairs if p.label > 0.5), "notice": LICENCE_NOTICE,
        "profile": str(target / "profile.toml"), "check": check.record(),
    }
