"""An export carries its base model's license: an HF directory's LICENSE / NOTICE files are copied into the
written directory, and a .gguf base's recorded license (general.license, .name, .link) goes to a README.md model
card's front matter, where the Hugging Face Hub and huggingface_hub.ModelCard read it. Exports wrote neither."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

import chronicals
from chronicals.cli import main
from chronicals.lora import apply_lora, save_adapter
from test_gguf import _tiny, write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = {"LICENSE": b"Apache License\nVersion 2.0\n", "notice.txt": b"Copyright the authors\n",
         "License.md": b"# terms\n"}


def _licensed_base(tmp_path, tiny_hf_config):
    """A tiny HF directory holding license files in three spellings, one a symlink to a blob elsewhere (as a Hub
    cache's snapshot holds every file), and files that are no license: a README.md and a LICENSE folder's cousin."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    base = chronicals.save_model(model, None, tmp_path / "base")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name, text in TEXTS.items():
        if name == "LICENSE":
            (blobs / "0a1b").write_bytes(text)
            (base / name).symlink_to(blobs / "0a1b")
        else:
            (base / name).write_bytes(text)
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\nthe base model's card\n")
    (base / "LICENSES_THIRD_PARTY").write_text("not one of the names\n")
    return base, model


def test_export_copies_the_base_directorys_license_files(tmp_path, tiny_hf_config, capsys):
    base, model = _licensed_base(tmp_path, tiny_hf_config)
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "out")]) == 0
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj"])
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
    assert main(["export", "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    out = capsys.readouterr().out
    assert out.count("license files of the base: LICENSE, License.md, notice.txt, and README.md (license: "
                     "apache-2.0, from its README.md front matter)") == 2, out
    for written in (tmp_path / "out", tmp_path / "merged"):
        for name, text in TEXTS.items():
            assert (written / name).read_bytes() == text and not (written / name).is_symlink(), name
        assert not (written / "LICENSES_THIRD_PARTY").exists()
        card = (written / "README.md").read_text()  # the license tag, not the base's card text
        assert ModelCard.load(written / "README.md").data.license == "apache-2.0" and "base model's card" not in card
    # an export written again over its own output: the license files it wrote are its own to replace
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "out")]) == 0


def test_a_license_file_of_the_users_own_in_out_is_never_replaced(tmp_path, tiny_hf_config, capsys):
    """A LICENSE in --out other than the base's (the user's own terms for the fine-tune, or another base's) is
    the user's: refused before the load, as any other file export would delete, not overwritten."""
    base, _ = _licensed_base(tmp_path, tiny_hf_config)
    out = tmp_path / "out"
    assert main(["export", "--model", str(base), "--out", str(out)]) == 0
    (out / "LICENSE").unlink()
    (out / "LICENSE").write_text("my own terms\n")
    capsys.readouterr()
    assert main(["export", "--model", str(base), "--out", str(out)]) == 2
    assert "holds files this save would delete (LICENSE)" in capsys.readouterr().err
    assert (out / "LICENSE").read_text() == "my own terms\n"


def test_a_license_named_only_in_the_base_cards_front_matter_is_carried(tmp_path, tiny_hf_config, capsys, caplog):
    """A Hub folder often names its license in README.md's front matter alone (SmolLM2's has no LICENSE file):
    the export's own card carries license, license_name and license_link, and nothing else of the base's card. A
    front matter that cannot be read is warned of and carries nothing; one without a license, nothing."""
    _, model = _tiny(tiny_hf_config, "llama2")
    base = chronicals.save_model(model, None, tmp_path / "base")
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE.txt\n"
                                    "tags: [x]\n---\nabout the base\n")
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "out")]) == 0
    assert "license of the base: README.md (license: other, from its README.md front matter)" in \
        capsys.readouterr().out
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny", "LICENSE.txt")
    assert card.data.tags is None and "about the base" not in card.text and "base/README.md" in card.text
    for i, text in enumerate(("---\ntags: [x]\n---\n", "no front matter\n", "---\nlicense: [unclosed\n---\n")):
        (base / "README.md").write_text(text)
        assert main(["export", "--model", str(base), "--out", str(tmp_path / f"out{i}")]) == 0
        assert not (tmp_path / f"out{i}" / "README.md").exists(), text
    assert "its front matter cannot be read" in caplog.text


def _licensed_gguf(tmp_path, tiny_hf_config, license=None, name=None, link=None):
    cfg, model = _tiny(tiny_hf_config, "qwen2")
    path = tmp_path / "m.gguf"

    def more(w):
        for value, add in ((license, w.add_license), (name, w.add_license_name), (link, w.add_license_link)):
            if value is not None:
                add(value)
    write_gguf(path, "qwen2", cfg, model.state_dict(), quantize=False, more=more)
    return path


def test_a_gguf_bases_license_goes_to_the_model_cards_front_matter(tmp_path, tiny_hf_config, capsys):
    link = "https://example.org/" + "terms/" * 12 + ": v2 # see"  # quoted for YAML's ': ' and ' #', past 80 columns
    path = _licensed_gguf(tmp_path, tiny_hf_config, license="other", name="tiny-license", link=link)
    assert main(["export", "--model", str(path), "--out", str(tmp_path / "hf")]) == 0
    assert "license of the base: README.md (license: other, from its GGUF metadata)" in capsys.readouterr().out
    card = ModelCard.load(tmp_path / "hf" / "README.md")
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny-license", link)
    written = (tmp_path / "hf" / "README.md").read_text()
    assert f"\nlicense_link: '{link}'\n" in written  # on one line (safe_dump folds at 80 columns)
    assert "m.gguf" in card.text and str(tmp_path) not in written  # the file's name, not where it lay
    assert main(["export", "--model", str(path), "--out", str(tmp_path / "hf")]) == 0  # its own README.md again


def test_a_gguf_base_without_a_license_gets_no_model_card(tmp_path, tiny_hf_config):
    from chronicals.models.license_files import license_files

    path = _licensed_gguf(tmp_path, tiny_hf_config)
    assert license_files(path) == {}
    assert main(["export", "--model", str(path), "--out", str(tmp_path / "hf")]) == 0
    assert not (tmp_path / "hf" / "README.md").exists()


def test_the_embedded_models_license_is_its_gguf_metadatas():
    from chronicals.models.license_files import license_files

    card = license_files("smollm2-135m-instruct")["README.md"].decode()
    assert card.startswith("---\nlicense: apache-2.0\n---\n"), card


@pytest.mark.parametrize("endianess", ["LITTLE", "BIG"])
def test_the_metadata_keys_read_as_gguf_py_reads_them(tmp_path, tiny_hf_config, endianess):
    """read_gguf_keys reads the key/value section alone (gguf.GGUFReader parsed SmolLM2's every token first, 3.5 s
    per export); each kind of value, skipped before a wanted key or read, in either byte order."""
    import gguf

    from chronicals.models.gguf_io import read_gguf_keys

    def more(w):
        w.add_array("t.strings", ["a", "", "ü" * 3])  # skipped one by one, before the wanted keys
        w.add_array("t.ints", [1, -2, 3])
        w.add_array("t.nested", [[1.5, 2.5], [3.5]])
        w.add_bool("t.bool", True)
        w.add_float64("t.f64", 0.1)
        w.add_int8("t.i8", -7)
        w.add_uint64("t.u64", 2**40)
        w.add_license("MIT OR Apache-2.0")

    cfg, model = _tiny(tiny_hf_config, "qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", cfg, model.state_dict(), quantize=False, more=more,
               endianess=getattr(gguf.GGUFEndian, endianess))
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    nested = fields.pop("t.nested")  # gguf-py's contents() flattens an array of arrays: [1.5, 2.5, 3.5]
    assert read_gguf_keys(path, set(fields)) == fields
    assert read_gguf_keys(path, {"t.nested"}) == {"t.nested": [[1.5, 2.5], [3.5]]} and nested == [1.5, 2.5, 3.5]
    assert read_gguf_keys(path, {"general.license", "no.such.key"}) == {"general.license": "MIT OR Apache-2.0"}
    data = path.read_bytes()
    path.write_bytes(data[:data.index(b"general.license") + 10])  # cut inside the metadata
    with pytest.raises(ValueError, match=rf"^{path}: not a readable GGUF file \(it ends at byte \d+, inside its "
                                         r"metadata\); the file is truncated or corrupt, copy it again$"):
        read_gguf_keys(path, {"general.license"})
    at = data.index(b"general.license") - 8  # the key's length field: 2^62, as a damaged file may say
    path.write_bytes(data[:at] + (2**62).to_bytes(8, "big" if endianess == "BIG" else "little") + data[at + 8:])
    with pytest.raises(ValueError, match=r"it ends at byte \d+, inside its metadata"):  # not a MemoryError
        read_gguf_keys(path, {"general.license"})


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "../LICENSE", ""])
def test_extra_files_cannot_replace_the_models_own_or_leave_the_directory(tmp_path, tiny_hf_config, name):
    _, model = _tiny(tiny_hf_config, "llama2")
    with pytest.raises(ValueError, match="not a plain file name or is one of the model directory's own files"):
        chronicals.save_model(model, None, tmp_path / "out", extra_files={name: b"x"})
    assert not (tmp_path / "out").exists()
