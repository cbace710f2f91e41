"""Held-out hygiene: held-out conversations that repeat a training prompt are found by the users' words."""

from __future__ import annotations

from capture.overlap import PromptIndex, drop_repeats, normalize, overlap, user_turns


def prompt(pid, question, system="Functions: f(x)"):
    return {"id": pid, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def sharegpt(cid, *humans):
    turns = []
    for h in humans:
        turns += [{"from": "human", "value": h}, {"from": "gpt", "value": "ok"}]
    return {"content_hash": cid, "conversations": turns}


def test_same_question_under_another_id_and_schema_is_a_repeat():
    """BFCL ships one user question in several categories with other function schemas: ids differ."""
    q = "Calculate the area of a triangle with base 10 and height 5."
    train = [prompt("multiple_155", q, system="Functions: area(b, h), perimeter(a, b, c)"), prompt("m2", "Other thing entirely here.")]
    held = [prompt("simple_python_243", "calculate the AREA of a triangle with base 10  and height 5."),
            prompt("simple_python_1", "Find the roots of x^2 - 4.")]
    rep = overlap(train, held)
    assert rep["repeats_training"] == 1 and rep["exact"] == 1
    assert rep["matches"]["simple_python_243"] == {"kind": "exact", "train_id": "multiple_155"}
    kept, _ = drop_repeats(train, held)
    assert [p["id"] for p in kept] == ["simple_python_1"]


def test_near_duplicates_are_repeats_and_different_questions_are_not():
    base = ("Write a Python function that takes a list of integers and returns the sum of the squares of "
            "the even numbers in the list, ignoring negative values")
    train = [sharegpt("t1", base)]
    near = sharegpt("h1", base.replace("Python function", "python function please"))
    other = sharegpt("h2", "Write a Python function that parses an ISO date string and returns the weekday name "
                           "in English, raising ValueError on bad input")
    rep = overlap(train, [near, other])
    assert rep["matches"] == {"h1": {"kind": "near", "train_id": "t1"}}
    # The same words in another order are a different text for shingles: not near.
    shuffled = sharegpt("h3", " ".join(reversed(base.split())))
    assert overlap(train, [shuffled])["repeats_training"] == 0


def test_short_generic_turns_never_match():
    train = [sharegpt("t", "Explain quicksort in detail please", "continue")]
    held = [sharegpt("h", "What is the capital of Peru and why", "continue"), sharegpt("h2", "thanks!")]
    assert overlap(train, held)["repeats_training"] == 0


def test_any_shared_turn_of_a_multi_turn_conversation_counts():
    train = [sharegpt("t", "How do I reverse a linked list in C?")]
    held = [sharegpt("h", "Tell me about pointers in C.", "How do I reverse a linked list in C?")]
    assert overlap(train, held)["matches"]["h"]["kind"] == "exact"


def test_normalization_and_turn_extraction():
    assert normalize("  Ｈｅｌｌｏ\tWORLD\n ") == "hello world"  # NFKC folds full-width letters
    assert user_turns(prompt("p", "q?")) == ["q?"]
    assert user_turns(sharegpt("c", "a", "b")) == ["a", "b"]
    idx = PromptIndex.build([prompt("x", "one two three four")])
    assert idx.match(prompt("y", "One  two three FOUR")) == ("exact", "x")
