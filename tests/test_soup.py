"""experiments/soup.py: the soup's weights are (1 - alpha) A + alpha B, exactly, and a folder in the way or models
of other shapes are one line before anything is written (the script run in this process: ``conftest.script_here``)."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import script_here
from densepass.models.biencoder import BiEncoder

SCRIPT = Path(__file__).parent.parent / "experiments" / "soup.py"


def _perturbed(tiny_model_dir, path: Path, seed: int) -> dict[str, torch.Tensor]:
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator))
    model.save(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_soup_is_the_weighted_mean_of_the_two_models(tiny_model_dir, tmp_path):
    a, b = _perturbed(tiny_model_dir, tmp_path / "a", 1), _perturbed(tiny_model_dir, tmp_path / "b", 2)
    run = [str(tmp_path / "a"), str(tmp_path / "b"), "--alpha", "0.25"]
    done = script_here(SCRIPT, *run, "--out", str(tmp_path / "soup"))
    assert done.returncode == 0, done.stderr
    soup = BiEncoder.from_pretrained(str(tmp_path / "soup")).state_dict()
    assert soup.keys() == a.keys()
    for name, tensor in soup.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, 0.75 * a[name] + 0.25 * b[name], rtol=1e-6, atol=1e-6, msg=name)
            assert not torch.equal(a[name], b[name])

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    done = script_here(SCRIPT, *run, "--out", str(notes))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "exists" in done.stderr
    assert sorted(p.name for p in notes.iterdir()) == ["mine.txt"]


def test_models_of_other_shapes_are_one_line_before_anything_is_written(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, BertModel

    _perturbed(tiny_model_dir, tmp_path / "a", 1)
    config = BertModel.config_class.from_pretrained(str(tiny_model_dir))
    config.num_hidden_layers = 1
    BertModel(config).save_pretrained(tmp_path / "b")
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "b")
    run = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "soup")]
    done = script_here(SCRIPT, *run)
    last = done.stderr.strip().splitlines()[-1]  # (loading progress bars before it)
    assert done.returncode == 2 and last.startswith("soup.py: error: ") and "layer.1" in last, done.stderr
    assert done.stderr.count("error") == 1 and not (tmp_path / "soup").exists()


def test_a_shared_model_and_two_towers_or_a_bad_alpha_are_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    """Their weights have the same names, but a two-tower model's passage tower would be dropped."""
    from densepass.config import BiEncoderConfig

    _perturbed(tiny_model_dir, tmp_path / "a", 1)
    BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(shared=False)).save(tmp_path / "b")
    run = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "soup")]
    done = script_here(SCRIPT, *run)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "differ in shared" in last, done.stderr
    done = script_here(SCRIPT, *run, "--alpha", "1.5")
    assert done.returncode == 2 and "--alpha must be from 0 to 1, got 1.5" in done.stderr
    assert not (tmp_path / "soup").exists()
