from dspark.decode.stopping import StopChecker
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.sampling import SamplingParams

G = SamplingParams()


def test_longest_most_recent_match_is_copied():
    d = PromptLookupDrafter(num_draft_tokens=3, max_ngram=3)
    d.begin([])
    d.observe([1, 2, 3, 9, 9, 5, 1, 2, 3, 4, 7, 8], None)
    # suffix (2, 3, anchor=4) never occurred; (3, 4) occurred once -> copy what followed it
    d.observe([5, 3], None)
    assert d.propose(4, 10, G, None).tokens == [7, 8, 5]
    # the budget caps the proposal; no match -> nothing
    assert d.propose(4, 1, G, None).tokens == [7]
    assert d.propose(42, 10, G, None).tokens == []


def test_stop_checker_cuts_text_before_the_stop_string():
    text_of = {1: "ab", 2: "c\n", 3: "\nd", 4: "e"}
    decode = lambda ids: "".join(text_of[i] for i in ids)
    c = StopChecker([99], 10, ["\n\n"], decode)
    assert c.push_many([1, 2, 3, 4]) == [1, 2, 3]
    assert c.finish_reason == "stop" and c.text() == "abc"
    c = StopChecker([3], 10, [], decode)
    assert c.push_many([1, 3, 4]) == [1, 3] and c.finish_reason == "stop"
    c = StopChecker([99], 2, [], decode)
    assert c.push_many([1, 2, 4]) == [1, 2] and c.finish_reason == "length"
