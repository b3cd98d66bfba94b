"""Sequence classifiers (`*ForSequenceClassification` checkpoints: text classifiers and
reward models): their labels, and what their logits become, for vLLM's /classify and
`LLM.classify`.

The worker pools them as it pools embeddings, at the prompt's last token, and sends the
score head's raw logits; the activation follows transformers' loss for the config's
`problem_type`, as vLLM's does: none for regression (a reward model's one score),
sigmoid for multi-label, otherwise softmax over the labels (sigmoid where there is one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from shared.hf.model_folder import config_or_empty

SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True, slots=True)
class Classifier:
    labels: tuple[str, ...]  # by class index
    problem_type: str | None = None  # transformers': regression, single_label_..., multi_label_...

    def probabilities(self, logits: list[float]) -> list[float]:
        if self.problem_type == "regression":
            return list(logits)
        if self.problem_type == "multi_label_classification" or len(logits) < 2:
            return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)) for x in logits]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]

    @property
    def cross_encoder(self) -> bool:
        """One label: a pair's score (vLLM's score task), as rerankers are trained."""
        return len(self.labels) == 1

    def label(self, probabilities: list[float]) -> str:
        return self.labels[max(range(len(probabilities)), key=probabilities.__getitem__)]


def num_labels(raw: dict) -> int:
    """transformers' rule: as many as id2label names, else num_labels, else 2."""
    return len(raw.get("id2label") or {}) or raw.get("num_labels") or 2


def is_classifier(raw: dict) -> bool:
    """Whether a config.json's architectures name a `*ForSequenceClassification`."""
    return any(str(a).endswith(SUFFIX) for a in raw.get("architectures") or [])


def classifier_of(model_path: str | Path) -> Classifier | None:
    """The model's classifier, when its config.json names a `*ForSequenceClassification`."""
    raw = config_or_empty(model_path)
    if not is_classifier(raw):
        return None
    names = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    labels = tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels(raw)))
    return Classifier(labels, raw.get("problem_type"))
