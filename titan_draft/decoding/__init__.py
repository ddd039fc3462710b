"""Speculative decoding against the real target: the greedy and sampling loops, acceptance accounting and the
true-acceptance evaluator that training and ``python -m titan_draft.eval`` run."""
