"""A draft chain gives a sequence's round to its first member that drafts it (engine/drafters/chain.py)."""

from specpool.engine.drafters.chain import DraftChain


def test_the_first_member_that_drafts_wins_and_no_drafts_end_the_chain():
    asked = []

    def member(name, answers):
        def draft(seq_id, n):
            asked.append(name)
            return answers.get(seq_id)
        return draft

    chain = DraftChain(member("endpoint", {"a": [1, 2]}), member("stop", {"b": []}), member("ngram", {"c": [3]}))
    assert chain.draft("a", 2) == [1, 2] and asked == ["endpoint"]
    asked.clear()
    assert chain.draft("b", 2) == [] and asked == ["endpoint", "stop"]  # an empty answer is an answer
    asked.clear()
    assert chain.draft("c", 2) == [3] and asked == ["endpoint", "stop", "ngram"]
    assert chain.draft("d", 2) is None  # every member declined
