import numpy as np
import pytest
import torch

from minicpmo_rt.errors import InputError
from minicpmo_rt.runtime.contracts import (IM_END_ID, TTS_EOS_ID, CodecChunk, PcmChunk, TalkerInput, ThinkerStep,
                                           TurnRequest)
from minicpmo_rt.talker.engine import CodecChunk as EngineChunk


def _steps(rid, n, terminator=None, after=0):
    rows = torch.randn(n + after, 8)
    steps = [ThinkerStep(rid, 10 + i, 100 + i, f"t{i}", rows[i], False) for i in range(n)]
    if terminator is not None:
        steps.append(ThinkerStep(rid, 10 + n, terminator, "", None, True))
    steps += [ThinkerStep(rid, 11 + n + j, 200 + j, "x", rows[n + j], False) for j in range(after)]
    return steps, rows


@pytest.mark.parametrize("terminator", [TTS_EOS_ID, IM_END_ID])
def test_talker_input_stops_at_the_terminator(terminator):
    steps, rows = _steps("a", 4, terminator, after=2)
    ti = TalkerInput.from_steps("a", steps)
    assert ti.token_ids == (100, 101, 102, 103) and ti.terminator == terminator
    assert torch.equal(ti.hidden, rows[:4]) and ti.text == "t0t1t2t3"
    req = ti.to_request(seed=5, max_codes=30)
    assert req.text_ids.tolist() == [100, 101, 102, 103] and req.hidden.shape == (4, 8)
    assert req.seed == 5 and req.max_codes == 30


def test_talker_input_errors():
    steps, _ = _steps("a", 0, TTS_EOS_ID)
    with pytest.raises(InputError, match="no text before terminator"):
        TalkerInput.from_steps("a", steps)
    steps, _ = _steps("b", 2)
    with pytest.raises(ValueError, match="request 'b'"):
        TalkerInput.from_steps("a", steps)


def test_step_and_chunk_records():
    with pytest.raises(ValueError, match="terminator carries no hidden"):
        ThinkerStep("a", 0, TTS_EOS_ID, "", torch.zeros(4), True)
    with pytest.raises(ValueError, match="terminator carries no hidden"):
        ThinkerStep("a", 0, 5, "", None, False)
    assert CodecChunk is EngineChunk
    src = np.arange(4, dtype=np.float64)
    pcm = PcmChunk("a", 0, src, True)
    assert pcm.samples.dtype == np.float32 and not pcm.samples.flags.writeable
    src[0] = 9  # the record holds its own copy
    assert pcm.samples[0] == 0
    with pytest.raises(ValueError):
        pcm.samples[0] = 1


@pytest.mark.parametrize("arg, msg", [("", "user text is empty"), ("   ", "user text is empty"),
                                      ([], "no messages"),
                                      ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       "last message must come from the user"),
                                      ([{"role": "robot", "content": "hi"}], "role")])
def test_turn_request_rejects_bad_messages(arg, msg):
    with pytest.raises(InputError, match=msg):
        TurnRequest.make("r", arg)


def test_turn_request_limits():
    with pytest.raises(InputError, match="max_codes"):
        TurnRequest.make("r", "hi", max_codes=0)
    with pytest.raises(InputError, match="request id"):
        TurnRequest.make("", "hi")
