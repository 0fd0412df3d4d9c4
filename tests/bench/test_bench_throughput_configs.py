"""`bench throughput --configs`: setups parse from short names, and each runs on the same requests."""
import json

import pytest

from ecoserve.bench.throughput import EngineSetup
from ecoserve.cli import main
from tests.utils import make_tiny_checkpoint


@pytest.mark.parametrize("text,want,name", [
    ("tp1", EngineSetup(), "tp1"), ("tp2", EngineSetup(tp=2), "tp2"), ("pp2", EngineSetup(pp=2), "pp2"),
    ("tp1t2", EngineSetup(threads=2), "tp1t2"), ("pp2@tdpipe", EngineSetup(pp=2, policy="tdpipe"), "pp2@tdpipe"),
    ("tp2pp2", EngineSetup(tp=2, pp=2), "tp2pp2"),
])
def test_setup_names_round_trip(text, want, name):
    assert EngineSetup.parse(text) == want
    assert want.name == name


@pytest.mark.parametrize("bad", ["", "tp", "pp2tp2", "2", "tp2@"])
def test_bad_setup_is_refused(bad):
    with pytest.raises(ValueError, match="--configs"):
        EngineSetup.parse(bad)


def test_configs_run_on_the_same_requests(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(model), "--num-prompts", "3", "--input-len-range", "4", "9",
                 "--output-len-range", "2", "5", "--num-threads", "1", "--no-tqdm", "--configs", "tp1", "tp1@prefill_first",
                 "--repeat", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["ecoserve tp1", "ecoserve tp1@prefill_first"]
    assert all(r["output_tokens_per_s"] > 0 for r in results)
