"""Generate the lesson sentiment dataset and its tokenizer, bit for bit the same on every run.

    python data/make_sentiment.py                 # rewrites data/sentiment/
    python data/make_sentiment.py --out /tmp/s    # writes a copy elsewhere (the tests do this)

Short English reviews of films and products, each labelled 0 (negative) or 1 (positive).
Every sentence is built from templates and word lists with a fixed seed, so the label is
known by construction. The label rule:

1. A clause has the polarity of its opinion word ("great" +, "dull" -, "loved" +, "hated" -,
   "I would recommend it" +, "a waste of money" -). Intensifiers ("very", "truly") change
   nothing; a negation ("not", "wasn't", "never", "hardly", "far from", "didn't") flips it
   once: "not bad" is positive, "not very good" is negative.
2. One clause, or clauses joined by "and" (which always agree), give the review that polarity.
3. Contrast: in "X but Y", "X, yet Y" and "X; however, Y" the clause after the contrast word
   decides. In "although X, Y", "X, although Y" and "X, even though Y" the main clause decides,
   never the one after "although" / "even though".
4. Neutral sentences ("I bought this kettle last week.") and openers ("honestly,") carry no
   opinion.

So the words alone do not give the label: "the plot was dull but the acting was great" and
"the plot was dull, although the acting was great" hold the same words with opposite labels.

Only the standard library and `tokenizers` are used, and the tokenizer files are written by
`tokenizers` and `json` (not by transformers' save_pretrained), so the bytes depend on this
script and not on the installed transformers version. transformers loads them like any hub
tokenizer: AutoTokenizer.from_pretrained("data/sentiment/tokenizer").
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20240613
N_TRAIN = 4000  # rows per split, half of them per label
N_TEST = 1000
MAX_LENGTH = 64  # tokens, [CLS] and [SEP] included; the longest review is well below
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

FILMS = ["movie", "film", "sequel", "documentary", "thriller", "comedy", "cartoon", "musical"]
FILM_ASPECTS = ["plot", "acting", "ending", "soundtrack", "dialogue", "pacing", "script",
                "camera work", "humor", "story", "direction", "music", "lead actor",
                "characters", "special effects", "jokes", "costumes"]
PRODUCTS = ["phone", "blender", "laptop", "kettle", "vacuum", "backpack", "camera", "toaster",
            "headphones", "speakers", "shoes", "charger", "lamp"]
PRODUCT_ASPECTS = ["battery", "screen", "price", "design", "sound", "build quality",
                   "delivery", "customer service", "packaging", "keyboard", "fit", "handle",
                   "instructions", "buttons", "colors", "cable", "materials"]
PLURAL = {"characters", "special effects", "jokes", "costumes", "headphones", "speakers",
          "shoes", "instructions", "buttons", "colors", "materials"}

POSITIVE = ["good", "great", "excellent", "wonderful", "fantastic", "superb", "solid",
            "impressive", "lovely", "brilliant", "decent", "outstanding", "pleasant", "amazing",
            "terrific", "perfect", "fine", "nice", "first rate", "delightful"]
NEGATIVE = ["bad", "awful", "terrible", "poor", "disappointing", "weak", "mediocre", "horrible",
            "dreadful", "lousy", "annoying", "sloppy", "subpar", "atrocious", "pathetic",
            "underwhelming", "unacceptable", "second rate", "irritating", "miserable"]
# opinion words that fit only one domain
DOMAIN_WORDS = {"film": {1: ["gripping", "moving", "funny", "clever", "enjoyable", "charming"],
                         0: ["dull", "boring", "predictable", "forgettable", "bland", "painful"]},
                "product": {1: ["reliable", "sturdy", "sleek", "handy", "practical", "durable"],
                            0: ["flimsy", "broken", "clunky", "useless", "cheap", "faulty"]}}
INTENSIFIERS = ["", "", "", "very", "really", "truly", "quite", "incredibly", "extremely",
                "absolutely", "pretty", "rather", "so", "genuinely", "remarkably"]
# (affirmative, negated) copulas; {be} is "was" / "were" or "is" / "are"
COPULAS = [("{be}", "{be} not"), ("{be}", "{be}n't"), ("{be}", "{be} never"),
           ("{be}", "{be} hardly"), ("{be}", "{be} far from"), ("{be}", "{be} not at all")]
LIKE = ["loved", "liked", "enjoyed", "adored", "appreciated"]
DISLIKE = ["hated", "disliked", "resented", "regretted"]
LIKE_BASE = {"loved": "love", "liked": "like", "enjoyed": "enjoy", "adored": "adore",
             "appreciated": "appreciate", "hated": "hate", "disliked": "dislike",
             "resented": "resent", "regretted": "regret"}
VERDICTS = {1: ["I would recommend it", "it is worth every penny", "I would buy it again",
                "I would watch it again", "it deserves five stars", "it was money well spent",
                "I am glad I got it", "it made my day"],
            0: ["I would not recommend it", "it is a waste of money", "I want my money back",
                "it deserves one star", "I regret buying it", "it was a total letdown",
                "I am sorry I got it", "it ruined my evening"]}
OPENERS = ["", "", "", "", "honestly, ", "overall, ", "to be honest, ", "in short, ",
           "well, ", "frankly, ", "I have to say ", "in my opinion, ", "all in all, "]
CONTEXT = {"film": ["we watched the {item} on friday.", "I saw this {item} with a friend.",
                    "my kids picked the {item} for movie night.",
                    "I streamed the {item} last weekend."],
           "product": ["I bought the {item} last week.", "I have used this {item} for a month.",
                       "my sister gave me this {item}.", "the {item} arrived on monday."]}


def clause(rng: random.Random, domain: str, item: str, polarity: int, past: bool,
           used: set[str]) -> str:
    """One opinion clause whose polarity (after any negation) is `polarity`.

    `past` picks "was" or "is"; aspects already in `used` are not picked again (and the new
    one is added), so a review never judges the same thing twice.
    """
    negated = rng.random() < 0.30
    word_polarity = polarity ^ negated  # a negation flips the opinion word's polarity
    aspects = [a for a in (FILM_ASPECTS if domain == "film" else PRODUCT_ASPECTS) + [item]
               if a not in used]
    aspect = rng.choice(aspects)
    kind = rng.random()
    if kind < 0.12:  # a verdict on the whole thing carries its own polarity, never negated
        return rng.choice(VERDICTS[polarity])
    used.add(aspect)
    if kind < 0.30:  # "I loved the plot" / "I didn't enjoy the battery"
        verb = rng.choice(LIKE if word_polarity else DISLIKE)
        if negated:
            verb = rng.choice(["did not ", "didn't ", "could not "]) + LIKE_BASE[verb]
        return f"I {verb} the {aspect}"
    plural = aspect in PLURAL
    be = ("were" if plural else "was") if past else ("are" if plural else "is")
    copula = rng.choice(COPULAS)[negated].format(be=be)
    adverb = "" if copula.endswith(("at all", "far from")) else rng.choice(INTENSIFIERS)
    words = (POSITIVE if word_polarity else NEGATIVE) + DOMAIN_WORDS[domain][word_polarity]
    return " ".join(w for w in ["the", aspect, copula, adverb, rng.choice(words)] if w)


def review(rng: random.Random) -> tuple[str, int, str]:
    """(text, label, structure) where structure is 'single', 'agree' or 'contrast'."""
    domain = rng.choice(["film", "product"])
    item = rng.choice(FILMS if domain == "film" else PRODUCTS)
    label = rng.randrange(2)
    past, used = rng.random() < 0.6, set()
    shape = rng.random()
    if shape < 0.45:
        structure, body = "single", clause(rng, domain, item, label, past, used)
    elif shape < 0.70:
        structure = "agree"
        body = " and ".join(clause(rng, domain, item, label, past, used) for _ in range(2))
    else:
        structure = "contrast"
        decides = clause(rng, domain, item, label, past, used)
        other = clause(rng, domain, item, 1 - label, past, used)
        body = rng.choice([f"{other} but {decides}", f"{other}, but {decides}",
                           f"{other}, yet {decides}", f"{other}; however, {decides}",
                           f"although {other}, {decides}", f"even though {other}, {decides}",
                           f"{decides}, although {other}", f"{decides}, even though {other}"])
    text = rng.choice(OPENERS) + body + rng.choice([".", ".", ".", "!", ""])
    text = text[0].upper() + text[1:]
    if rng.random() < 0.15:
        text = rng.choice(CONTEXT[domain]).format(item=item) + " " + text
    return text[0].upper() + text[1:], label, structure


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """Balanced, disjoint train and test rows: distinct texts, exactly half per label."""
    rng = random.Random(seed)
    per_label = (N_TRAIN + N_TEST) // 2
    by_label: dict[int, dict[str, dict]] = {0: {}, 1: {}}
    while min(len(rows) for rows in by_label.values()) < per_label:
        text, label, structure = review(rng)
        rows = by_label[label]
        if len(rows) < per_label and not any(text in r for r in by_label.values()):
            rows[text] = {"text": text, "label": label, "structure": structure}
    train, test = [], []
    for label in (0, 1):
        rows = list(by_label[label].values())
        rng.shuffle(rows)
        test += rows[:N_TEST // 2]
        train += rows[N_TEST // 2:]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def build_tokenizer(texts: list[str]):
    """A lowercase word-level tokenizer over every word in `texts`, BERT-style specials."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = sorted({word for text in texts for word, _ in
                    pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))})
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


# What AutoTokenizer reads beside tokenizer.json; the same keys a hub BERT tokenizer has.
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_LENGTH,
                    "padding_side": "right", "truncation_side": "right",
                    "model_input_names": ["input_ids", "attention_mask"],
                    "unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                    "sep_token": "[SEP]", "mask_token": "[MASK]"}


def write(out: Path, seed: int = SEED) -> list[Path]:
    """Write train.jsonl, test.jsonl and tokenizer/ under `out`; return the paths written."""
    train, test = generate(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(exist_ok=True)
    paths = []
    for name, rows in (("train", train), ("test", test)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row, ensure_ascii=True) + "\n" for row in rows),
                        encoding="utf-8", newline="\n")
        paths.append(path)
    tokenizer = build_tokenizer([row["text"] for row in train + test])
    tokenizer_json = out / "tokenizer" / "tokenizer.json"
    tokenizer_json.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8", newline="\n")
    config_json = out / "tokenizer" / "tokenizer_config.json"
    config_json.write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n", encoding="utf-8",
                           newline="\n")
    return paths + [tokenizer_json, config_json]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "sentiment",
                        help="folder to write (default: data/sentiment next to this script)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"random seed (default {SEED})")
    args = parser.parse_args(argv)
    for path in write(args.out, args.seed):
        print(f"{path}  {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
