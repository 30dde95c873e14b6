"""Nothing in a `.pt2` a user hands neuronc can run code: every member that would need an unrestricted
unpickler, a Python call or an evaluated expression is refused with a ModelLoadError naming it, and the
command exits 1 without the payload ever running."""
from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.errors import ModelLoadError
from neuronc.frontend.exported import load_exported_program


class _Payload:
    """Pickles as a call of os.system that creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.scale = torch.tensor([2.0, 3.0, 4.0])  # a tensor constant

    def forward(self, x):
        return self.linear(x) * self.scale


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _pickled_weight(name, data, marker):
    if name.endswith("model_weights_config.json"):
        config = json.loads(data)
        config["config"]["linear.weight"]["use_pickle"] = True
        return json.dumps(config).encode()
    return _torch_saved({"w": _Payload(marker)}) if name.endswith("data/weights/weight_0") else data


def _pickled_constant(name, data, marker):
    if name.endswith("model_constants_config.json"):
        config = json.loads(data)
        config["config"]["scale"].update(path_name="opaque_obj_0", use_pickle=True)
        return json.dumps(config).encode()
    return pickle.dumps(_Payload(marker)) if name.endswith("data/constants/tensor_0") else data


def _pickled_sample_inputs(name, data, marker):
    return _torch_saved(((_Payload(marker),), {})) if name.endswith("sample_inputs/model.pt") else data


def _python_call_target(name, data, marker):
    return data.replace(b'"torch.ops.aten.mul.Tensor"', b'"torch.os.system"') if name.endswith("model.json") else data


def _evaluated_shape_expression(name, data, marker):
    if not name.endswith("models/model.json"):
        return data
    program = json.loads(data)
    sizes = program["graph_module"]["graph"]["tensor_values"]["linear"]["sizes"]
    sizes[0] = {"as_expr": {"expr_str": f"__import__('os').system('touch {marker}')", "hint": {"as_int": 2}}}
    return json.dumps(program).encode()


PAYLOADS = {  # where the payload sits -> (edit of each archive member, the member the error must name)
    "pickled weight": (_pickled_weight, "data/weights/weight_0"),
    "pickled constant": (_pickled_constant, "data/constants/opaque_obj_0"),
    "pickled sample inputs": (_pickled_sample_inputs, "data/sample_inputs/model.pt"),
    "python call target": (_python_call_target, "models/model.json"),
    "shape expression": (_evaluated_shape_expression, "models/model.json"),
}


@pytest.fixture(scope="module")
def clean_archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    torch.export.save(torch.export.export(_Linear(), (torch.randn(2, 4),)), str(path))
    return path


def _crafted(clean, path, edit, marker):
    with zipfile.ZipFile(clean) as source, zipfile.ZipFile(path, "w") as crafted:
        for info in source.infolist():
            crafted.writestr(info.filename, edit(info.filename, source.read(info.filename), marker))
        if edit is _pickled_constant:
            crafted.writestr(f"{path.stem}/data/constants/opaque_obj_0", pickle.dumps(_Payload(marker)))
    return path


@pytest.mark.parametrize("where", sorted(set(PAYLOADS) - {"python call target"}))
def test_torch_export_load_itself_runs_these_payloads(clean_archive, tmp_path, where):
    """The crafted archives are real attacks: PyTorch's own loader runs their payloads. (A Python call target
    it resolves and then refuses: a program that ran would call it.)"""
    edit, _ = PAYLOADS[where]
    marker = tmp_path / "ran"
    path = _crafted(clean_archive, tmp_path / "model.pt2", edit, str(marker))
    try:
        torch.export.load(str(path))
    except Exception:  # noqa: BLE001 - whether it then fails does not matter: the payload ran first
        pass
    assert marker.exists()


@pytest.mark.parametrize("command", ["compile", "check", "hlo"])
@pytest.mark.parametrize("where", sorted(PAYLOADS))
def test_a_crafted_archive_is_refused_naming_the_member_and_never_runs_its_payload(
        clean_archive, tmp_path, where, command):
    edit, member = PAYLOADS[where]
    marker = tmp_path / "ran"
    path = _crafted(clean_archive, tmp_path / "model.pt2", edit, str(marker))
    args = [command, str(path)] + (["-o", str(tmp_path / "model.neff")] if command == "compile" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert f"model/{member}" in result.output
    assert not marker.exists()
    assert not (tmp_path / "model.neff").exists()


def test_loading_refuses_with_a_model_load_error_naming_the_member(clean_archive, tmp_path):
    marker = tmp_path / "ran"
    path = _crafted(clean_archive, tmp_path / "model.pt2", _pickled_weight,
                    str(marker))
    with pytest.raises(ModelLoadError, match="model/data/weights/weight_0 needs an unrestricted unpickler"):
        load_exported_program(path)
    assert not marker.exists()


def test_a_clean_archive_loads_with_its_weights_constants_and_sample_inputs(clean_archive):
    model = _Linear()
    program = load_exported_program(clean_archive)
    assert set(program.state_dict) == {"linear.weight", "linear.bias"}
    assert torch.equal(program.constants["scale"], model.scale)
    (x,), _ = program.example_inputs
    assert x.shape == (2, 4)
    assert isinstance(program.state_dict["linear.weight"], torch.nn.Parameter)


def test_a_tensor_declaring_more_elements_than_its_record_holds_is_refused(clean_archive, tmp_path):
    def grow(name, data, marker):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            config["config"]["linear.weight"]["tensor_meta"]["sizes"] = [{"as_int": 3000}, {"as_int": 4000}]
            return json.dumps(config).encode()
        return data

    path = _crafted(clean_archive, tmp_path / "model.pt2", grow, "")
    with pytest.raises(ModelLoadError, match="weight_0 holds 12 elements"):
        load_exported_program(path)


def test_a_member_larger_than_the_host_budget_is_refused_before_it_is_read(clean_archive, monkeypatch):
    monkeypatch.setenv("NEURONC_HOST_MEMORY_BUDGET", "1K")
    with pytest.raises(ModelLoadError, match=r"model/models/model.json expands to \d+ bytes, more than the host"):
        load_exported_program(clean_archive)
