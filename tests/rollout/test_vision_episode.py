"""An environment that shows images, through the episode, against the real embedded engine serving a
tiny vision-language model: the engine gets one placeholder per image and the image itself, the
trajectory records the expanded prompt it consumed and references the image by content hash, and the
group store holds the image's bytes once. Images to a text-only model, or on a later turn, end the
episode as the environment's error, named."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from transformers import AutoConfig, AutoTokenizer

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.envs.base import Observation, StepResult
from rollout.episode import EpisodeConfig, run_episode
from rollout.ports import Generation, RolloutObserver
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import Vision, content_hash, data_url, image_bytes
from tests.rollout.test_engine_vision import png


class DigitPicture:
    name = "picture"

    def __init__(self, image: bytes, later: Observation | None = None) -> None:
        self.image, self.later = image, later

    def reset(self, seed: int) -> Observation:
        return Observation("which digit?", (self.image,))

    def step(self, action: str) -> StepResult:
        if self.later is not None:
            return StepResult(self.later, 0.5, False)
        return StepResult(None, 1.0, True)


def _engine_generate(engine: EmbeddedEngine, calls: list):
    async def generate(ids, sampling, tid, timeout_s, images=()):
        calls.append((list(ids), images))
        urls = [data_url(x) for x in images]
        out = await asyncio.wrap_future(engine.submit(f"{tid}-{len(calls)}", ids, sampling, image_data=urls))
        return Generation(
            out.output_ids, out.behavior_logprobs, out.token_versions, FinishReason.of_engine(out.finish_reason["type"])
        )

    return generate


CONFIG = EpisodeConfig(max_turns=3, sampling=SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True))


@pytest.fixture(scope="module")
def served(tiny_vl):
    engine = EmbeddedEngine(EngineConfig(model_path=tiny_vl, max_running_requests=2)).start()
    yield tiny_vl, engine, AutoTokenizer.from_pretrained(tiny_vl), Vision(tiny_vl, AutoConfig.from_pretrained(tiny_vl))
    engine.shutdown()


def _run(env, generate, tok, vision, store):
    return asyncio.run(
        run_episode(
            env,
            0,
            generate,
            tok,
            CONFIG,
            trajectory_id="t",
            group_id="g",
            prompt_id="p",
            vision=vision,
            image_store=store,
        )
    )


def test_the_engine_sees_the_image_and_the_trajectory_records_what_it_consumed(served):
    _, engine, tok, vision = served
    image = image_bytes(png(28, 28, 5))
    calls, store = [], {}
    traj = _run(DigitPicture(image), _engine_generate(engine, calls), tok, vision, store)
    assert traj.finish_reason == FinishReason.LENGTH and traj.reward == 1.0  # 4 tokens, then the env's reward
    ((sent, images),) = calls
    assert images == (image,) and sent.count(vision.image_token_id) == 1  # one placeholder, the image beside it
    expanded = vision.prompt(sent, [data_url(image)]).input_ids
    assert len(expanded) == len(sent) - 1 + 16  # 28 px → 16 tokens
    assert list(traj.token_ids[: len(expanded)]) == expanded and int(traj.loss_mask.sum()) == 4
    assert traj.images == (content_hash(image),) and store == {content_hash(image): image}


def test_images_to_a_text_only_model_or_on_a_later_turn_are_the_environments_error(served):
    _, engine, tok, vision = served
    image = image_bytes(png(28, 28, 6))
    calls = []
    blind = _run(DigitPicture(image), _engine_generate(engine, calls), tok, None, {})
    assert blind.finish_reason == FinishReason.ENV_ERROR and blind.metadata["error_kind"] == "images" and not calls
    later = _run(
        DigitPicture(image, later=Observation("and this?", (image,))), _engine_generate(engine, calls), tok, vision, {}
    )
    assert later.finish_reason == FinishReason.ENV_ERROR and later.metadata["error"] == "images after the first turn"
    assert len(calls) == 1  # the first turn ran; the second was never sent


def test_a_sampled_image_placeholder_ends_the_member_and_the_loop_drops_it(served):
    from rollout.loop import RolloutLoop

    _, _, tok, vision = served
    seen = []

    async def generate(ids, sampling, tid, timeout_s, images=()):
        seen.append(sampling.stop_token_ids)
        return Generation([40, vision.image_token_id], [-1.0, -2.0], [0, 0], FinishReason.STOP)

    traj = _run(DigitPicture(image_bytes(png(28, 28, 7))), generate, tok, vision, {})
    assert seen == [[vision.image_token_id]]  # the engines stop at it
    assert traj.finish_reason == FinishReason.ERROR and traj.metadata["error_kind"] == "image_token"
    loop = RolloutLoop.__new__(RolloutLoop)  # only its bookkeeping of dropped members
    loop.counters, loop.observer = Counter(), RolloutObserver()
    assert not loop._usable("g", traj) and loop.counters["members_dropped_image_token"] == 1


class Talkative(DigitPicture):
    """Shows the picture, then answers in text: the second turn re-sends the picture with the context."""

    name = "talk"

    def __init__(self, image: bytes, first_text: str = "which digit?") -> None:
        super().__init__(image)
        self.turn, self.first_text = 0, first_text

    def reset(self, seed: int) -> Observation:
        return Observation(self.first_text, (self.image,))

    def step(self, action: str) -> StepResult:
        self.turn += 1
        return StepResult("are you sure?", 0.0, False) if self.turn == 1 else StepResult(None, 1.0, True)


def test_a_second_text_turn_sends_the_compact_context_with_the_picture_again(served):
    _, engine, tok, vision = served
    image = image_bytes(png(28, 28, 8))
    calls, store = [], {}
    traj = _run(Talkative(image), _engine_generate(engine, calls), tok, vision, store)
    assert traj.finish_reason == FinishReason.LENGTH and len(calls) == 2
    (first, images1), (second, images2) = calls
    assert images1 == images2 == (image,) and second.count(vision.image_token_id) == 1
    expanded = vision.prompt(first, [data_url(image)]).input_ids
    # the trajectory: the expanded prompt, then exactly what was sent after the compact one, then the last answer
    middle = second[len(first) :]
    tokens = list(traj.token_ids)
    assert tokens[: len(expanded)] == expanded and tokens[len(expanded) : len(expanded) + len(middle)] == middle
    assert len(tokens) == len(expanded) + len(middle) + 4
    assert second[: len(first)] == first and int(traj.loss_mask.sum()) == 8


def test_an_image_placeholder_written_in_the_text_is_the_environments_error(served):
    _, engine, tok, vision = served
    image = image_bytes(png(28, 28, 9))
    calls = []
    traj = _run(
        Talkative(image, first_text="look <|image_pad|> here"), _engine_generate(engine, calls), tok, vision, {}
    )
    assert (
        traj.finish_reason == FinishReason.ENV_ERROR and traj.metadata["error"] == "2 image placeholders for 1 images"
    )
    assert not calls
