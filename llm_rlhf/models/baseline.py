"""The reward model's yardstick: a bag-of-words Bradley-Terry model fitted on the same training pairs.

A linear reward r(x, y) = w . phi(x + y) over TF-IDF word uni- and bigrams, fitted with the pairwise
logistic loss -log sigmoid(r(chosen) - r(rejected)): a logistic regression without intercept on the
feature differences phi(chosen) - phi(rejected), each pair also shown swapped with label 0 so both
classes exist. Its held-out pairwise accuracy is reported next to the RM's: a reward model that does
not beat it has learned nothing a word count could not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import vstack
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression


def pairwise_accuracy(chosen_scores, rejected_scores) -> float:
    """Fraction of pairs with score(chosen) > score(rejected); a tie counts one half (chance)."""
    chosen_scores, rejected_scores = np.asarray(chosen_scores, float), np.asarray(rejected_scores, float)
    wins = (chosen_scores > rejected_scores) + 0.5 * (chosen_scores == rejected_scores)  # (N,)
    return float(wins.mean())


@dataclass
class BowBaseline:
    vectorizer: object  # sklearn TfidfVectorizer
    weights: np.ndarray  # (F,) one weight per n-gram
    C: float  # inverse regularisation strength that was picked

    def scores(self, texts: list[str]) -> np.ndarray:
        """r(text) = w . phi(text): (N,)."""
        return np.asarray(self.vectorizer.transform(texts) @ self.weights).ravel()

    def accuracy(self, chosen: list[str], rejected: list[str]) -> float:
        return pairwise_accuracy(self.scores(chosen), self.scores(rejected))


def fit_bow_baseline(
    chosen: list[str],
    rejected: list[str],
    *,
    eval_chosen: list[str] | None = None,
    eval_rejected: list[str] | None = None,
    Cs: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0),
) -> BowBaseline:
    """Fit on the training pairs (full texts: prompt + response). With eval pairs, the regularisation
    strength C is picked by their pairwise accuracy (the RM gets the same eval set for monitoring)."""
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, lowercase=True)
    vectorizer.fit(list(chosen) + list(rejected))
    diff = vectorizer.transform(chosen) - vectorizer.transform(rejected)  # (N, F) phi(y_w) - phi(y_l)
    features = vstack([diff, -diff])  # (2N, F): each pair in both orders
    labels = np.concatenate([np.ones(diff.shape[0]), np.zeros(diff.shape[0])])  # (2N,)

    best = None
    for C in Cs if eval_chosen is not None else (1.0,):
        classifier = LogisticRegression(C=C, fit_intercept=False, max_iter=2000)
        classifier.fit(features, labels)
        candidate = BowBaseline(vectorizer, classifier.coef_.ravel(), C)
        if eval_chosen is None:
            return candidate
        accuracy = candidate.accuracy(eval_chosen, eval_rejected)
        if best is None or accuracy > best[0]:
            best = (accuracy, candidate)
    return best[1]
