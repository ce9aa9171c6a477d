"""Build the "reviews" default task data (``data/reviews/*.jsonl``) from the VADER ICWSM-2014 ratings.

Source: human-rated sentiment snippets of Hutto & Gilbert (2014), MIT license, shipped inside the
PyPI source distribution of ``vaderSentiment==3.3.2`` (see ``../shared/data/vader_icwsm2014/PROVENANCE.md``).
Every movie-review sentence was rated by 15-29 people on -4 (extremely negative) .. +4 (extremely
positive); "more positive is better" is the human preference of this task.

Regenerating from scratch on a machine that can reach PyPI:

1. Fetch the source distribution only (no wheel, no dependencies) of vaderSentiment 3.3.2 into a
   folder ``vader``: ``pip download --no-deps --no-binary :all: -d vader vaderSentiment==3.3.2``.
   Its sha256 is 5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9.
2. Unpack it (``tar xzf vader/vaderSentiment-3.3.2.tar.gz -C vader``), then unpack the archive it
   carries, ``vader/vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz``, with
   ``tar xzf ... -C vader``; the ``*_GroundTruth.txt`` and ``*_anonDataRatings.txt`` files are the input.
3. ``python data/make_reviews.py --source <folder holding those files> --out data/reviews``.

The output is a pure function of the input files: no randomness, every "random-looking" choice is
an order by a salted sha1 hash. The rules (split, openings, pairing, rankings, prompt caps) are
documented function by function below and, with the row counts, in ``data/README.md``.
Pure python + stdlib on purpose, so a fresh clone rebuilds it without the toolkit installed.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "data" / "vader_icwsm2014"

MIN_WORDS = 4  # sentences shorter than this are dropped everywhere
SPLIT_PERCENT = {"train": 80, "val": 10, "test": 10}
PAIR_MIN_MARGIN = 1.0  # chosen and rejected differ by >= 1.0 in mean human rating (scale -4..+4)
PAIRS_PER_SENTENCE = 4  # each sentence appears in at most this many preference pairs
RANKING_MIN_SIZE, RANKING_MAX_SIZE = 3, 4
EVAL_PROMPTS_MAX = 256

EXTRA_SETS = (  # never evaluated: only used for pretraining the base model and its tokenizer
    "amazonReviewSnippets_GroundTruth.txt",
    "nytEditorialSnippets_GroundTruth.txt",
    "tweets_GroundTruth.txt",
)


@dataclass(frozen=True)
class Sentence:
    id: str
    text: str
    rating: float  # mean of the individual ratings
    ratings: tuple[int, ...]


def sha1_key(*parts: str) -> str:
    """A stable pseudo-random sort key; the salt ("reviews-v1") is part of the data version."""
    return hashlib.sha1("\x1f".join(("reviews-v1",) + parts).encode("utf-8")).hexdigest()


def normalise(text: str) -> str:
    """Minimal clean-up: HTML entities (``&amp;``) decoded, ``''`` -> ``"``, whitespace collapsed, stripped."""
    text = html.unescape(text).replace("''", '"')
    return re.sub(r"\s+", " ", text).strip()


def read_tsv(path: Path) -> list[list[str]]:
    """Rows of a UTF-8 (optional BOM), CRLF, tab-separated source file; the last column keeps any tabs."""
    text = path.read_text(encoding="utf-8-sig")
    return [line.split("\t") for line in text.splitlines() if line.strip()]


def load_movie(source: Path) -> list[Sentence]:
    """Movie snippets joined with their individual ratings; short and duplicate sentences removed.

    Duplicates (same normalised text, case-insensitive) keep the lowest id, so the same sentence can
    never land in two splits.
    """
    ratings = {}
    for row in read_tsv(source / "movieReviewSnippets_anonDataRatings.txt"):
        ratings[row[0]] = tuple(int(r) for r in json.loads(row[3]))  # "[3, 2, -1, ...]"
    sentences, seen = [], set()
    for row in read_tsv(source / "movieReviewSnippets_GroundTruth.txt"):
        sid, mean, raw = row[0], float(row[1]), "\t".join(row[2:])
        text = normalise(raw)
        rs = ratings[sid]
        if abs(sum(rs) / len(rs) - mean) > 1e-6:
            raise ValueError(f"sentence {sid}: mean rating {mean} != mean of its individual ratings")
        if len(text.split()) < MIN_WORDS or text.lower() in seen:
            continue
        seen.add(text.lower())
        sentences.append(Sentence(sid, text, mean, rs))
    return sentences


def load_extra(source: Path) -> list[str]:
    """Normalised sentences of the Amazon, NYT and tweet sets (>= MIN_WORDS words), in file order."""
    texts = []
    for name in EXTRA_SETS:
        for row in read_tsv(source / name):
            text = normalise("\t".join(row[2:]))
            if len(text.split()) >= MIN_WORDS:
                texts.append(text)
    return texts


def split_of(sentence: Sentence) -> str:
    """80/10/10 by sentence: sha1 of the sentence id, mod 100 -> [0, 80) train, [80, 90) val, [90, 100) test."""
    bucket = int(sha1_key("split", sentence.id), 16) % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    return "val" if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["val"] else "test"


def sft_prompt_words(n_words: int) -> int:
    """The SFT/PPO opening: the first 3 words, or the first 2 if the sentence has fewer than 6 words."""
    return 3 if n_words >= 6 else 2


def cut(text: str, k: int) -> tuple[str, str]:
    """(first k words, " " + the rest): prompt + completion == text because whitespace is collapsed."""
    words = text.split(" ")
    return " ".join(words[:k]), " " + " ".join(words[k:])


def opening_groups(sentences: list[Sentence]) -> list[tuple[int, list[Sentence]]]:
    """Groups of >= 2 sentences that share an opening, as (number of opening words, members by id).

    Level 1: the first 2 words, matched case-insensitively. Level 2: the sentences whose 2-word
    opening no other sentence of the split shares are grouped by their first word (1-word prompt);
    without level 2 the val and test splits would yield only a few hundred pairs.
    """

    def by_opening(members: list[Sentence], k: int) -> dict[str, list[Sentence]]:
        groups = defaultdict(list)
        for s in members:
            groups[" ".join(s.text.split(" ")[:k]).lower()].append(s)
        return groups

    def id_order(s: Sentence) -> tuple[int, str]:
        head = s.id.split("_")[0]
        return (int(head), s.id) if head.isdigit() else (0, s.id)

    two = by_opening(sentences, 2)
    singles = [g[0] for g in two.values() if len(g) == 1]
    groups = [(2, g) for g in two.values() if len(g) >= 2]
    groups += [(1, g) for g in by_opening(singles, 1).values() if len(g) >= 2]
    groups = [(k, sorted(g, key=id_order)) for k, g in groups]
    return sorted(groups, key=lambda kg: (kg[0], kg[1][0].text.lower()))


def group_prompt(group: list[Sentence], k: int) -> str:
    """The group's opening in its most common casing (ties: the lowest-id sentence's), so that
    prompt + continuation is the real sentence for all but a few case-variant members."""
    openings = [cut(s.text, k)[0] for s in group]
    return max(openings, key=lambda o: (openings.count(o), -openings.index(o)))


def preference_pairs(sentences: list[Sentence]) -> list[dict]:
    """Pairs of real continuations of the same opening, the higher mean human rating is ``chosen``.

    Rule: within an opening group (see ``opening_groups``), every two sentences whose mean ratings
    differ by >= PAIR_MIN_MARGIN and whose continuations differ are candidates; candidates are
    visited in sha1 order and accepted while both sentences are in fewer than c pairs, for
    c = 1, 2, ..., PAIRS_PER_SENTENCE (rounds spread the pairs evenly over sentences, and cap big
    groups such as "The film ..." at 2 pairs per member on average). The prompt is the group's
    opening (``group_prompt``); chosen/rejected are the text after it.
    ``margin`` = chosen rating - rejected rating.
    """
    pairs = []
    for k, group in opening_groups(sentences):
        prompt = group_prompt(group, k)
        rest = {s.id: cut(s.text, k)[1] for s in group}
        candidates = []
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if abs(a.rating - b.rating) >= PAIR_MIN_MARGIN and rest[a.id] != rest[b.id]:
                    candidates.append((sha1_key("pair", a.id, b.id), a, b))
        candidates.sort(key=lambda c: c[0])
        degree: dict[str, int] = defaultdict(int)
        accepted = set()
        for cap in range(1, PAIRS_PER_SENTENCE + 1):
            for key, a, b in candidates:
                if key not in accepted and degree[a.id] < cap and degree[b.id] < cap:
                    accepted.add(key)
                    degree[a.id] += 1
                    degree[b.id] += 1
                    hi, lo = (a, b) if a.rating > b.rating else (b, a)
                    pairs.append(
                        {
                            "prompt": prompt,
                            "chosen": rest[hi.id],
                            "rejected": rest[lo.id],
                            "margin": round(hi.rating - lo.rating, 4),
                        }
                    )
    return pairs


def rankings(sentences: list[Sentence]) -> list[dict]:
    """Rankings of 3-4 continuations of one opening, best first, consecutive ratings >= PAIR_MIN_MARGIN apart.

    Rule: within an opening group, visit the unused sentences in sha1 order; the first one seeds a
    chain and every later one whose rating is >= PAIR_MIN_MARGIN away from all chain members joins,
    up to RANKING_MAX_SIZE. A chain of >= RANKING_MIN_SIZE becomes a ranking (its members are used);
    otherwise only the seed is discarded. Each sentence is in at most one ranking.
    """
    out = []
    for k, group in opening_groups(sentences):
        prompt = group_prompt(group, k)
        pool = sorted(group, key=lambda s: sha1_key("rank", s.id))
        while len(pool) >= RANKING_MIN_SIZE:
            chain = [pool[0]]
            for s in pool[1:]:
                if len(chain) == RANKING_MAX_SIZE:
                    break
                if all(abs(s.rating - c.rating) >= PAIR_MIN_MARGIN for c in chain):
                    if all(cut(s.text, k)[1] != cut(c.text, k)[1] for c in chain):
                        chain.append(s)
            if len(chain) >= RANKING_MIN_SIZE:
                chain.sort(key=lambda s: -s.rating)
                out.append({"prompt": prompt, "ranked": [cut(s.text, k)[1] for s in chain]})
                pool = [s for s in pool if s not in chain]
            else:
                pool = pool[1:]
    return out


def sft_rows(sentences: list[Sentence]) -> list[dict]:
    rows = []
    for s in sentences:
        prompt, completion = cut(s.text, sft_prompt_words(len(s.text.split(" "))))
        rows.append({"prompt": prompt, "completion": completion})
    return rows


def unique_openings(sentences: list[Sentence]) -> list[str]:
    """SFT openings (``sft_prompt_words``) in sentence order, exact duplicates removed."""
    return list(dict.fromkeys(row["prompt"] for row in sft_rows(sentences)))


def gold_rows(sentences: list[Sentence]) -> list[dict]:
    return [{"text": s.text, "rating": s.rating, "ratings": list(s.ratings)} for s in sentences]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(source: Path, out: Path) -> dict[str, int]:
    """Write every file of the task to ``out``; returns {file name: row count}."""
    movie = load_movie(source)
    split = {"train": [], "val": [], "test": []}
    for s in movie:
        split[split_of(s)].append(s)

    held_out = {s.text.lower() for s in split["val"] + split["test"]}
    # Leak guard: an extra-set sentence identical to a held-out movie sentence is left out.
    extra = [t for t in load_extra(source) if t.lower() not in held_out]
    pretrain = list(dict.fromkeys([s.text for s in split["train"]] + extra))

    ppo_prompts = unique_openings(split["train"])
    seen = {p.lower() for p in ppo_prompts}
    eval_prompts = [p for p in unique_openings(split["test"]) if p.lower() not in seen]
    eval_prompts = sorted(eval_prompts, key=lambda p: sha1_key("eval", p))[:EVAL_PROMPTS_MAX]

    files = {
        "pretrain.jsonl": [{"text": t} for t in pretrain],
        "sft_train.jsonl": sft_rows(split["train"]),
        "sft_val.jsonl": sft_rows(split["val"]),
        "prefs_train.jsonl": preference_pairs(split["train"]),
        "prefs_val.jsonl": preference_pairs(split["val"]),
        "prefs_test.jsonl": preference_pairs(split["test"]),
        "rankings_train.jsonl": rankings(split["train"]),
        "ppo_prompts.jsonl": [{"prompt": p} for p in ppo_prompts],
        "eval_prompts.jsonl": [{"prompt": p} for p in eval_prompts],
        "gold_train.jsonl": gold_rows(split["train"]),
        "gold_test.jsonl": gold_rows(split["test"]),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        write_jsonl(out / name, rows)
    counts = {name: len(rows) for name, rows in files.items()}
    counts.update({f"movie sentences ({k})": len(v) for k, v in split.items()})
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="folder with the VADER files")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "reviews", help="output folder")
    args = parser.parse_args()
    for name, n in build(args.source, args.out).items():
        print(f"{name:32s} {n:7d}")


if __name__ == "__main__":
    main()
