"""Sharded loading and the partition rules, without processes: each rank's tensors are slices of the whole."""
import pytest
import torch

from ecoserve.model.loader import build_model
from ecoserve.model.parallel import HeadShard, ShardPlan, padded_vocab, partition_layers
from ecoserve.model.spec import ModelLoadError, ModelSpec
from tests.utils import make_tiny_checkpoint


class NoComm:
    """Loading never communicates; only size and rank are read."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def test_partition_rule_gives_the_remainder_to_the_stages_before_the_last():
    assert [len(r) for r in partition_layers(40, 4)] == [10, 10, 10, 10]
    assert [len(r) for r in partition_layers(42, 4)] == [10, 11, 11, 10]
    assert [len(r) for r in partition_layers(7, 3)] == [2, 3, 2]
    assert partition_layers(5, 2, (4, 1)) == [range(0, 4), range(4, 5)]
    with pytest.raises(ValueError, match="summing to the model's 5 layers"):
        partition_layers(5, 2, (2, 2))
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        partition_layers(2, 3)


def test_head_shards_split_or_replicate_kv_heads():
    spec = ModelSpec.from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128,
                                  "vocab_size": 100})
    assert HeadShard.of(spec, 2, 1) == HeadShard(4, 1, 4, 1)
    assert [HeadShard.of(spec, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]  # replicated KV heads
    with pytest.raises(ModelLoadError, match="must divide the 8 attention heads"):
        HeadShard.of(spec, 3, 0)
    assert padded_vocab(100, 8) == 104


@pytest.mark.parametrize("tied", [False, True])
def test_rank_shards_are_slices_of_the_full_model(tmp_path, tied):
    path = make_tiny_checkpoint(tmp_path / "m", num_layers=2, tie_word_embeddings=tied, vocab_size=509)
    spec = ModelSpec.from_dir(path)
    full = build_model(spec, path, torch.float32, "cpu")
    d, q_local, kv_local = spec.head_dim, spec.num_heads // 2, spec.num_kv_heads // 2
    for rank in range(2):
        shard = build_model(spec, path, torch.float32, "cpu", ShardPlan(rank, 2, 1, 2, 1, 2), NoComm(2, rank))
        assert shard.embed_tokens is None and len(shard.layers) == 1
        want_layer, got_layer = full.layers[1].self_attn, shard.layers[0].self_attn
        q_rows = slice(rank * q_local * d, (rank + 1) * q_local * d)
        k0 = spec.num_heads * d + rank * kv_local * d
        want_qkv = torch.cat([want_layer.qkv_proj.weight[q_rows], want_layer.qkv_proj.weight[k0:k0 + kv_local * d]])
        assert torch.equal(got_layer.qkv_proj.weight[:q_local * d + kv_local * d], want_qkv)
        assert torch.equal(got_layer.o_proj.weight, want_layer.o_proj.weight[:, q_rows])
        head = shard.lm_head.weight  # vocab 509 padded to 510: rank 1's last row is padding
        rows = full.lm_head.weight[rank * 255:(rank + 1) * 255]
        assert torch.equal(head[:rows.shape[0]], rows) and (head[rows.shape[0]:] == 0).all()
