"""Ranks of one parallel instance: worker processes, their step messages and torch.distributed plumbing."""
