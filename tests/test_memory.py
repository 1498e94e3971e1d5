"""ZeRO-3 gathers parameters by units, the repeated layers of the model, and holds few at once.

At its worst step a rank holds at most prefetch + 1 gathered units (the one
computing and those gathered ahead; one without overlap) besides the parameters
outside units, for the example GPT (layers `blocks.N`) and for a Hugging Face
model (`model.layers.N`). Units are found without being named, or named with
the option `units`; `units.txt` says which they are.
"""
import pytest

from ranks import run_ranks
from training import tiny_llama, units_worker, zero3_memory_sweep, zero3_memory_worker

SETTINGS = [(False, 1), (True, 1)]  # (overlap, prefetch)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_zero3_holds_at_most_prefetch_plus_one_units_at_its_worst_step(model):
    for rank, runs in enumerate(run_ranks(zero3_memory_sweep, 2, model, 4, SETTINGS)):
        for (overlap, prefetch), m in zip(SETTINGS, runs):
            held = prefetch + 1 if overlap else 1
            context = (model, rank, overlap, prefetch, m)
            assert m["worst_peak_gathered"] <= held * m["largest_unit"] + m["outside_units"], context
            # Each unit is gathered whole, as one bucket, and prefetching holds the next ones with it.
            assert m["peak_gathered"] >= held * m["largest_unit"], context


def test_zero2_gathers_every_parameter_for_the_whole_step():
    # The contrast that makes the ZeRO-3 bound meaningful: ZeRO-2 holds all full parameters at once.
    for m in run_ranks(zero3_memory_worker, 2, 2):
        assert m["peak_gathered"] >= m["all_params_padded"] - 1, m


def _rows(text: str, section: str) -> dict[str, tuple[int, int, int]]:
    """The (parameters, elements, bytes) of each row of a table of `units.txt` ("unit" or "module")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [section]) + 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        name, parameters, elements, nbytes = line.split()[:4]
        rows[name] = (int(parameters), int(elements), int(nbytes))
    return rows


def _size(parameters) -> tuple[int, int, int]:
    parameters = list(parameters)
    return len(parameters), sum(p.numel() for p in parameters), sum(p.numel() * p.element_size() for p in parameters)


def test_units_of_a_hugging_face_model_found_or_named(tmp_path):
    model = tiny_llama()
    layers = {f"model.layers.{i}": _size(layer.parameters()) for i, layer in enumerate(model.model.layers)}
    outside = {name: _size(model.get_submodule(name).parameters()) for name in ("model.embed_tokens", "model.norm",
                                                                                  "lm_head")}
    attention = {f"model.layers.{i}.self_attn": _size(layer.self_attn.parameters())
                 for i, layer in enumerate(model.model.layers)}
    mlp = {f"model.layers.{i}.mlp": _size(layer.mlp.parameters()) for i, layer in enumerate(model.model.layers)}
    cases = [None, ["LlamaAttention"], ["model.layers.*.mlp"], ["LlamaDecoderLayer", "model.layers", "Block"]]
    for rank, (found, by_class, by_name, error) in enumerate(run_ranks(units_worker, 2, cases, str(tmp_path))):
        assert _rows(found, "unit") == layers, (rank, found)
        assert _rows(found, "module") == outside, (rank, found)
        assert f"{len(layers)} units, largest model.layers.0 ({layers['model.layers.0'][2]} bytes)" in found
        assert _rows(by_class, "unit") == attention, (rank, by_class)
        assert _rows(by_name, "unit") == mlp, (rank, by_name)
        # The list is no module whose forward runs, and no module of the model is a Block: on every rank.
        key, message = error
        assert key == "units" and "['model.layers', 'Block'] name none" in message, error
