import json

import pytest

from minicpmo_rt.checkpoint.config import MiniCPMOConfig, load_config
from minicpmo_rt.checkpoint.tiny import reference_config, tiny_config
from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.errors import CheckpointError


def test_reference_config_parses():
    cfg = MiniCPMOConfig.from_dict(reference_config())
    assert cfg.llm.hidden_size == 4096 and cfg.llm.num_hidden_layers == 36
    assert cfg.vision.num_hidden_layers == 27 and cfg.audio.d_model == 1024
    assert cfg.tts.num_audio_tokens == 6562 and cfg.tts.hidden_size == 768
    assert cfg.slicing.max_slice_nums == 9


def test_tiny_config_keeps_ids_and_shrinks_dims():
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    assert cfg.llm.vocab_size == 151748 and cfg.tts.num_text_tokens == 152064
    assert cfg.llm.hidden_size == 128 and cfg.llm.hidden_size // 128 >= 1
    assert cfg.audio.encoder_ffn_dim // 4 == cfg.audio.d_model


@pytest.mark.parametrize("version", [4.0, "2.6", None])
def test_wrong_version_is_refused_and_named(tmp_path, version):
    data = reference_config()
    if version is None:
        del data["version"]
    else:
        data["version"] = version
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=repr(version).replace(".", r"\.")):
        load_config(tmp_path)


def test_string_version_accepted(tmp_path):
    data = reference_config()
    data["version"] = "4.5"
    assert MiniCPMOConfig.from_dict(data).version == "4.5"


def test_missing_subconfig_named():
    data = reference_config()
    del data["audio_config"]
    with pytest.raises(CheckpointError, match="audio_config"):
        MiniCPMOConfig.from_dict(data)


def test_special_ids_match_added_tokens(shared_dir):
    tok = load_tokenizer(vendored_tokenizer_dir())
    added = json.loads((shared_dir / "added_tokens.json").read_text())
    for token, idx in added.items():
        assert tok.token_to_id(token) == idx, token
    s = tok.special
    assert (s.im_end, s.tts_bos, s.tts_eos, s.unk, s.listen) == (151645, 151703, 151704, 128244, 151705)
    assert tok.vocab_size == 151748


def test_encode_decode_roundtrip_and_qwen_ids():
    tok = load_tokenizer(vendored_tokenizer_dir())
    text = "<|im_start|>user\nHello, world! 你好 123<|im_end|>\n<|tts_bos|>"
    ids = tok.encode(text)
    # Qwen2 BPE ids: 'user' 872, '\n' 198, 'Hello' 9707, ',' 11, ' world' 1879; digits split singly.
    assert ids[:7] == [151644, 872, 198, 9707, 11, 1879, 0]
    assert ids[-6:] == [16, 17, 18, 151645, 198, 151703]
    assert tok.decode(ids) == text


def test_missing_tokenizer_file_named(tmp_path):
    with pytest.raises(CheckpointError, match="vocab.json"):
        load_tokenizer(tmp_path)
