from __future__ import annotations

import json

import pytest

from minicpmo_rt.checkpoint.tokenizer import vendored_tokenizer_dir
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker import image_processor as ip
from minicpmo_rt.thinker import prompt as P



def test_documented_ids_match_tokenizer(tok):
    s = tok.special
    pairs = [(P.IM_START_ID, s.im_start), (P.IM_END_ID, s.im_end), (P.ENDOFTEXT_ID, s.endoftext),
             (P.UNK_ID, s.unk), (P.TTS_BOS_ID, s.tts_bos), (P.TTS_EOS_ID, s.tts_eos), (P.LISTEN_ID, s.listen),
             (P.TURN_EOS_ID, s.turn_eos), (P.CHUNK_EOS_ID, s.chunk_eos), (P.CHUNK_TTS_EOS_ID, s.chunk_tts_eos)]
    for const, real in pairs:
        assert const == real
    assert P.TURN_TERMINATORS == (151704, 151645, 128247)
    assert tok.token_to_id("</s>") == P.EOS_S_ID  # upstream's third turn terminator is a real token here


def _jinja_reference(messages, **kw):
    jinja2 = pytest.importorskip("jinja2")
    cfg = json.loads((vendored_tokenizer_dir() / "tokenizer_config.json").read_text())
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = json.dumps
    return env.from_string(cfg["chat_template"]).render(messages=messages, tools=None, **kw)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nplan\n</think>\n\na1"}, {"role": "user", "content": "q2"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nanswer"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "plain"},
     {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"}, {"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "q"}, {"role": "system", "content": "late system"}],
]


@pytest.mark.parametrize("msgs", CONVERSATIONS)
@pytest.mark.parametrize("kw", [dict(add_generation_prompt=False),
                                dict(add_generation_prompt=True, enable_thinking=False, use_tts_template=True),
                                dict(add_generation_prompt=True)])
def test_chat_template_matches_tokenizer_config_jinja(msgs, kw):
    assert P.apply_chat_template(msgs, **kw) == _jinja_reference(msgs, **kw)


def test_chat_template_rejects_non_text_and_unknown_role():
    with pytest.raises(InputError, match="content"):
        P.apply_chat_template([{"role": "user", "content": [1, 2]}])
    with pytest.raises(InputError, match="role"):
        P.apply_chat_template([{"role": "robot", "content": "x"}])


def test_assistant_bos_ids(tok):
    s = tok.special
    bos = P.PromptBuilder(tok).assistant_bos()
    assert bos.text == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|tts_bos|>"
    assert bos.ids[0] == s.im_end and bos.ids[-1] == s.tts_bos
    assert bos.ids[2] == s.im_start
    assert s.think_start in bos.ids and s.think_end in bos.ids
    assert tok.decode(bos.ids) == bos.text
    assert P.PromptBuilder(tok).assistant_bos(use_tts_template=False).ids == bos.ids[:-1]


def test_audio_counts_and_placeholders():
    assert [P.audio_embed_count(n) for n in (16000, 16480, 16560, 32000, 8000, 1600, 800)] == [10, 10, 10, 20, 5, 1, 0]
    assert P.audio_placeholder(16000) == "<|audio_start|>" + "<unk>" * 10 + "<|audio_end|>"
    assert P.audio_placeholder(25000, chunk_input=True) == ("<|audio_start|>" + "<unk>" * 10 + "<|audio_end|>"
                                                           + "<|audio_start|>" + "<unk>" * 5 + "<|audio_end|>")  # 157 mel -> 79 -> 15
    with pytest.raises(InputError, match="audio"):
        P.audio_embed_count(0)


def test_turn_user_segments(tok):
    s, b = tok.special, P.PromptBuilder(tok)
    frame = ip.process_image(__import__("numpy").zeros((50, 80, 3), "uint8"))
    first = b.user_segment(["Look: ", frame, 16480])
    assert first.ids[:1] == (s.im_start,) and s.im_end not in first.ids
    assert [(x.kind, x.length) for x in first.slots] == [("image", 64), ("audio", 10)]
    for sl in first.slots:
        assert set(first.ids[sl.start: sl.start + sl.length]) == {s.unk}
        assert first.ids[sl.start - 1] in (s.image_start, s.audio_start)
        assert first.ids[sl.start + sl.length] in (s.image_end, s.audio_end)
    later = b.user_segment([16000], first_of_turn=False)
    assert later.ids == (s.audio_start,) + (s.unk,) * 10 + (s.audio_end,)
    again = b.user_segment(["hi"], after_generation=True)
    assert again.ids[:3] == (s.tts_eos, s.im_end, tok.encode("\n")[0]) and again.ids[3] == s.im_start
    done = b.user_segment(["hi"], after_generation=True, generation_completed=True)
    assert done.ids == again.ids[1:]
    # <|listen|> never reaches the model in turn mode (upstream _convert drops it).
    assert s.listen not in b.user_segment(["a<|listen|>b"]).ids


def test_sliced_image_placeholder_slots(tok):
    b = P.PromptBuilder(tok)
    big = ip.process_image(__import__("numpy").zeros((500, 1000, 3), "uint8"), max_slice_nums=9)
    piece = b.user_segment([big], first_of_turn=False)
    assert [x.length for x in piece.slots] == [64] * big.num_sub_images == [64] * 3


def test_system_turn_with_reference_audio(tok):
    b = P.PromptBuilder(tok)
    pre, post = P.system_prompt_parts("audio_assistant", has_ref_audio=True)
    piece = b.system_turn(pre, ref_audio_samples=48000, after=post)
    assert piece.text == ("<|im_start|>system\n" + pre + "<|audio_start|>" + "<unk>" * 30 + "<|audio_end|>"
                          + post + "<|im_end|>\n")
    assert piece.slot_lengths("audio") == [30]
    assert P.system_prompt_parts() == (P.DEFAULT_SYSTEM_PROMPT, None)
    with pytest.raises(InputError, match="ref"):
        P.system_prompt_parts("voice_cloning")


def test_duplex_layouts(tok):
    s, b = tok.special, P.PromptBuilder(tok)
    sysp = b.duplex_system(ref_audio_embeds=20)
    assert sysp.text.startswith("<|im_start|>system\nStreaming Omni Conversation.\n<|audio_start|>")
    assert sysp.ids[-2:] == (s.audio_end, s.im_end) and sysp.slot_lengths("audio") == [20]
    assert sysp.ids[sysp.slots[0].start - 1] == s.audio_start
    listen_unit = b.duplex_unit(audio_embeds=10) + b.duplex_unit_end(s.listen)
    assert len(listen_unit) == 13  # <unit> + 10 + <|listen|> + </unit>
    assert listen_unit.ids[0] == s.unit_start and listen_unit.ids[-2:] == (s.listen, s.unit_end)
    av = b.duplex_unit([1], audio_embeds=10)
    assert len(av) == 1 + 66 + 10
    assert [(x.kind, x.start, x.length) for x in av.slots] == [("image", 2, 64), ("audio", 67, 10)]
    sliced = b.duplex_unit([3], audio_embeds=0)
    assert sliced.ids.count(s.slice_start) == 2 and len(sliced) == 1 + 3 * 66
    assert b.duplex_unit_end(None).ids == (s.unit_end,)
