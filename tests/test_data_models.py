"""The lesson dataset, its tokenizer, the lesson model, and loading models by path."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # these tests never reach for the hub

import collections  # noqa: E402
import filecmp  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mplab import data, models  # noqa: E402

SENTIMENT = data.DATA_DIR / "sentiment"


@pytest.fixture(scope="module")
def tokenizer():
    return models.lesson_tokenizer()


def rows(split):
    return [json.loads(line) for line in (SENTIMENT / f"{split}.jsonl").read_text().splitlines()]


# --- the dataset ---------------------------------------------------------------------------

def test_regenerating_the_data_reproduces_every_committed_file_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(data.DATA_DIR / "make_sentiment.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True, env={**os.environ})
    committed = sorted(p.relative_to(SENTIMENT) for p in SENTIMENT.rglob("*") if p.is_file())
    regenerated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == regenerated
    for name in committed:
        assert filecmp.cmp(SENTIMENT / name, tmp_path / name, shallow=False), name


def test_each_split_is_balanced_between_the_two_labels():
    for split, size in (("train", 4000), ("test", 1000)):
        ds = data.load_dataset("sentiment", split)
        assert len(ds) == size
        assert collections.Counter(ds.labels) == {0: size // 2, 1: size // 2}
        assert ds.label_names == ("negative", "positive") and ds.num_labels == 2


def test_train_and_test_share_no_text_and_no_text_repeats():
    train, test = data.load_dataset("sentiment", "train"), data.load_dataset("sentiment", "test")
    assert len(set(train.texts)) == len(train) and len(set(test.texts)) == len(test)
    assert not set(train.texts) & set(test.texts)


def test_the_words_alone_do_not_give_the_label():
    structures = collections.Counter(row["structure"] for row in rows("train"))
    assert set(structures) == {"single", "agree", "contrast"}
    assert structures["contrast"] > 0.2 * sum(structures.values())
    texts = " ".join(data.load_dataset("sentiment", "test").texts).lower()
    for marker in (" but ", "although ", " not ", "n't ", " never ", "far from"):
        assert marker in texts, marker
    positive = [r["text"].lower() for r in rows("train") if r["label"] == 1]
    assert any("not bad" in t or "not terrible" in t or "n't bad" in t for t in positive)


def test_the_data_folder_stays_small():
    """The reviews and tokenizer (0.6 MB) and the two fp32 warm starts (1.45 MB)."""
    size = sum(p.stat().st_size for p in data.DATA_DIR.rglob("*") if p.is_file())
    assert size < 2_500_000


def test_a_folder_or_a_jsonl_file_loads_like_the_shipped_name(tmp_path):
    by_name = data.load_dataset("sentiment", "test")
    assert data.load_dataset(SENTIMENT, "test").texts == by_name.texts
    by_file = data.load_dataset(str(SENTIMENT / "test.jsonl"))
    assert (by_file.texts, by_file.labels) == (by_name.texts, by_name.labels)
    (tmp_path / "train.jsonl").write_text('{"text": "fine", "label": 2}\n\n'
                                          '{"text": "meh", "label": 0}\n')
    three = data.load_dataset(tmp_path)
    assert three.texts == ["fine", "meh"] and three.label_names == ("0", "1", "2")
    assert data.shipped_datasets() == ["sentiment"]


# --- the tokenizer -------------------------------------------------------------------------

def test_the_tokenizer_loads_like_a_hub_tokenizer_and_round_trips_every_text(tokenizer,
                                                                               tmp_path):
    from transformers import AutoTokenizer

    texts = data.load_dataset("sentiment", "test").texts
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 1)
    ids = tokenizer(texts)["input_ids"]
    assert all(row[0] == tokenizer.cls_token_id and row[-1] == tokenizer.sep_token_id
               for row in ids)
    assert not any(tokenizer.unk_token_id in row for row in ids)  # every word is known
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    for text, row in zip(texts, ids):
        words = [w for w, _ in pre.pre_tokenize_str(text.lower())]
        assert tokenizer.convert_ids_to_tokens(row[1:-1]) == words
        assert tokenizer.decode(row, skip_special_tokens=True) == " ".join(words)
    assert tokenizer("Not BAD at all!")["input_ids"] == tokenizer("not bad at all !")["input_ids"]
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(texts)["input_ids"] == ids


def test_encode_pads_to_the_longest_text_and_truncates_at_max_length(tokenizer):
    enc = data.encode(tokenizer, ["good", "the plot was not very good"], [1, 0])
    assert enc["input_ids"].shape == enc["attention_mask"].shape == (2, 8)
    assert enc["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]
    assert enc["labels"].tolist() == [1, 0] and enc["labels"].dtype == torch.long
    assert data.encode(tokenizer, ["the plot was not very good"], max_length=4)[
        "input_ids"].shape == (1, 4)
    assert "labels" not in data.encode(tokenizer, ["good"])


def test_batches_cover_every_row_once_in_a_seeded_order_without_spare_padding(tokenizer):
    ds = data.load_dataset("sentiment", "test")
    enc = data.encode(tokenizer, ds.texts, ds.labels)
    for by_length in (False, True):
        first = list(data.batches(enc, batch_size=64, seed=3, device="cpu", by_length=by_length))
        again = list(data.batches(enc, batch_size=64, seed=3, device="cpu", by_length=by_length))
        other = list(data.batches(enc, batch_size=64, seed=4, device="cpu", by_length=by_length))
        assert sorted(len(b["labels"]) for b in first) == [40] + [64] * 15
        seen = sorted(tuple(r) for b in first for r in b["input_ids"][:, :8].tolist())
        assert seen == sorted(tuple(r) for r in enc["input_ids"][:, :8].tolist())
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
        assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])
        assert all(b["attention_mask"][:, -1].any() for b in first)  # no all-padding column
        assert all(set(b) == {"input_ids", "attention_mask", "labels"} for b in first)
    plain = list(data.batches(enc, batch_size=64, seed=0, device="cpu"))
    grouped = list(data.batches(enc, batch_size=64, seed=0, device="cpu", by_length=True))
    assert sum(b["input_ids"].numel() for b in grouped) < 0.8 * sum(
        b["input_ids"].numel() for b in plain)
    in_order = list(data.batches(enc, batch_size=500, shuffle=False, device="cpu"))
    assert torch.equal(torch.cat([b["labels"] for b in in_order]), enc["labels"])
    assert len(list(data.batches(enc, batch_size=300, device="cpu", drop_last=True))) == 3


# --- the model -----------------------------------------------------------------------------

def test_the_lesson_model_is_small_and_its_weights_depend_only_on_the_seed(tokenizer):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = models.lesson_model(seed=0), models.lesson_model(seed=0), models.lesson_model(seed=1)
    assert torch.equal(torch.rand(3), before)  # the global random state is left alone
    weights = [dict(m.named_parameters()) for m in (a, b, c)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["classifier.weight"], weights[2]["classifier.weight"])
    assert sum(p.numel() for p in a.parameters()) < 1_000_000
    assert a.config.vocab_size == len(tokenizer) and a.config.pad_token_id == 0
    assert a.config.max_position_embeddings >= tokenizer.model_max_length
    deeper = models.lesson_model(num_labels=3, num_hidden_layers=3)
    assert deeper.config.num_hidden_layers == 3 and deeper.classifier.out_features == 3


@pytest.mark.slow
def test_the_lesson_model_learns_every_kind_of_review(tokenizer, course_run):
    """The shared course run (tests/conftest.py) classifies each sentence structure of the
    test split (plain, negated, contrasted) well above chance; prints accuracy per structure."""
    result, model = course_run
    test = data.load_dataset("sentiment", "test")
    test_enc = data.encode(tokenizer, test.texts, test.labels)
    model.eval()
    with torch.no_grad():
        # The mask hides the padding a length-grouped batch would not have had.
        predicted = torch.cat([model(input_ids=b["input_ids"],
                                     attention_mask=b["attention_mask"]).logits.argmax(-1)
                               for b in data.batches(test_enc, 250, shuffle=False, device="cpu")])
    right = (predicted == test_enc["labels"]).tolist()
    by_structure = collections.defaultdict(list)
    for row, ok in zip(rows("test"), right):
        by_structure[row["structure"]].append(ok)
    detail = {k: sum(v) / len(v) for k, v in sorted(by_structure.items())}
    print(f"\nlesson model after {len(result.losses)} steps, by structure: {detail}")
    assert sum(right) / len(right) >= 0.80
    assert min(detail.values()) >= 0.65, detail


def test_load_pretrained_reads_a_saved_folder_back_to_identical_logits(tokenizer, tmp_path):
    model = models.lesson_model(seed=5).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = models.load_pretrained(tmp_path)
    texts = ["The plot was dull, but the acting was great.", "I would not recommend it"]
    enc = data.encode(tokenizer, texts)
    assert torch.equal(data.encode(loaded_tokenizer, texts)["input_ids"], enc["input_ids"])
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(**enc).logits, model(**enc).logits)
    assert type(loaded) is type(model)
    three, _ = models.load_pretrained(str(tmp_path), num_labels=3)  # a fresh 3-way head
    assert three.classifier.out_features == 3


# --- bad input -----------------------------------------------------------------------------

def test_bad_dataset_requests_name_what_was_given_and_what_is_accepted(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"no split 'validation'.*'test', 'train'"):
        data.load_dataset("sentiment", "validation")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `datasets` were not installed
    with pytest.raises(ValueError, match=r"'sentimnet'.*'sentiment'.*pip install datasets"):
        data.load_dataset("sentimnet")
    with pytest.raises(ValueError, match=r"no such file or folder"):
        data.load_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"is empty"):
        data.load_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "good"}\n')
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object with 'text' and 'label'"):
        data.load_dataset(tmp_path / "bad.jsonl")
    (tmp_path / "float.jsonl").write_text('{"text": "good", "label": 0.5}\n')
    with pytest.raises(ValueError, match=r"integer label"):
        data.load_dataset(tmp_path / "float.jsonl")
    (tmp_path / "no_jsonl").mkdir()
    with pytest.raises(ValueError, match=r"no split 'train'.*none"):
        data.load_dataset(tmp_path / "no_jsonl")
    with pytest.raises(ValueError, match=r"name or a path"):
        data.load_dataset("")


def test_bad_encode_and_batch_arguments_say_what_is_accepted(tokenizer):
    with pytest.raises(ValueError, match=r"2 texts but 1 labels"):
        data.encode(tokenizer, ["good", "bad"], [1])
    with pytest.raises(ValueError, match=r"no texts"):
        data.encode(tokenizer, [])
    with pytest.raises(ValueError, match=r"texts\[1\] is 3"):
        data.encode(tokenizer, ["good", 3])
    with pytest.raises(ValueError, match=r"max_length"):
        data.encode(tokenizer, ["good"], max_length=1)
    enc = data.encode(tokenizer, ["good"], [1])
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        next(data.batches(enc, batch_size=0))
    with pytest.raises(ValueError, match=r"takes the dict that encode\(\) returns"):
        next(data.batches([1, 2, 3]))
    with pytest.raises(ValueError, match=r"unknown device 'gpu'"):
        next(data.batches(enc, device="gpu"))


def test_bad_model_requests_name_what_was_given_and_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"num_labels must be a positive integer, got 0"):
        models.lesson_model(num_labels=0)
    with pytest.raises(ValueError, match=r"hidden_size \(128\) must be a multiple of "
                                         r"num_attention_heads \(3\)"):
        models.lesson_model(num_attention_heads=3)
    with pytest.raises(ValueError, match=r"not a saved model folder.*save_pretrained"):
        models.load_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"not a saved model folder"):
        models.load_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no tokenizer at .*make_sentiment.py"):
        models.lesson_tokenizer(tmp_path)


# ---- the warm starts: losses that show learning within a lesson's steps ---------------------

def test_the_warm_start_is_the_shipped_encoder_with_a_head_drawn_from_the_seed():
    from safetensors.torch import load_file

    shipped = load_file(models.LESSON_PRETRAINED / "model.safetensors")
    a, b = models.lesson_model(pretrained=True), models.lesson_model(pretrained=True)
    other = models.lesson_model(pretrained=True, seed=1)
    weights = a.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in shipped.items())  # the encoder, as saved
    assert not any(k.startswith(("bert.pooler", "classifier")) for k in shipped)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in weights.items())  # seeded
    assert not torch.equal(a.classifier.weight, other.classifier.weight)
    assert next(a.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="shape is fixed"):
        models.lesson_model(pretrained=True, hidden_size=64)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_lesson_run_from_the_warm_start_starts_at_chance_and_learns(precision):
    """Lesson 4's settings at the fewest steps a lesson runs (12, for a precision the CPU has
    no units for; 100 elsewhere): the loss starts near ln 2 and falls at least a quarter of
    the way to 0. (The lab's runs are held to it in test_diagnosis.)"""
    import math
    import warnings

    from mplab.plots import learned_share
    from mplab.train import TrainWarning, train

    with warnings.catch_warnings():  # "bf16 on this CPU is slow", where it has no units
        warnings.simplefilter("ignore", TrainWarning)
        result = train(model="lesson-pretrained", precision=precision, steps=12, lr=1e-3,
                       warmup_steps=5, schedule="constant", eval_samples=0, progress=False,
                       device="cpu")
    assert result.losses[0] == pytest.approx(math.log(2), abs=0.05)
    assert learned_share(result.losses) >= 0.25, result.losses

