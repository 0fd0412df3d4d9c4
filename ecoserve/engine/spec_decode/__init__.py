"""Speculative decoding: proposers guess a request's next tokens, the target verifies them in one forward pass.

`speculator.Speculator` is what the engine holds: each step it asks a `SpeculationLength` how many tokens each
decoding request may propose and a proposer (`ngram.NgramProposer`, `draft.DraftModelProposer`) for them; the
scheduler puts them in the request's decode chunk, and the model runner accepts them by rejection sampling
(`verify.verify`), so outputs keep the target's distribution exactly.
"""
