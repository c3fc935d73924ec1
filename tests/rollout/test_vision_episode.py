"""An environment that shows images, through the episode, against the real embedded engine serving a
tiny vision-language model: the engine gets one placeholder per image and the image itself, the
trajectory records the expanded prompt it consumed and references the image by content hash, and the
group store holds the image's bytes once. A later turn may show more, and the trainer's forward over
them all gives the engine's log-probs. Images to a text-only model end the episode as the
environment's error, named."""

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
from sample_buffer.codec import decode_group, encode_group
from sample_buffer.trajectory import FinishReason, Group
from sample_buffer.vision import Vision, content_hash, data_url, image_bytes
from tests.rollout.test_engine_vision import png
from trainer.batch import batch_from_groups
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine


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


def test_images_to_a_text_only_model_are_the_environments_error(served):
    _, engine, tok, _ = served
    calls = []
    blind = _run(DigitPicture(image_bytes(png(28, 28, 6))), _engine_generate(engine, calls), tok, None, {})
    assert blind.finish_reason == FinishReason.ENV_ERROR and blind.metadata["error_kind"] == "images" and not calls


def test_a_later_turn_may_show_more_pictures_and_the_trainer_sees_them_all(served):
    path, engine, tok, vision = served
    first, later = image_bytes(png(28, 28, 6)), image_bytes(png(20, 36, 7))
    calls, store = [], {}
    traj = _run(
        DigitPicture(first, later=Observation("and this?", (later,))),
        _engine_generate(engine, calls),
        tok,
        vision,
        store,
    )
    assert traj.finish_reason == FinishReason.LENGTH and len(calls) == 3  # max_turns: each step shows one more
    assert [images for _, images in calls] == [(first,), (first, later), (first, later, later)]
    assert [ids.count(vision.image_token_id) for ids, _ in calls] == [1, 2, 3]  # one placeholder each, as sent
    # the step after the last turn showed one more: the trajectory ends with that observation, as a text one's
    hashes = (content_hash(first), *[content_hash(later)] * 3)
    assert traj.images == hashes and store == {content_hash(first): first, content_hash(later): later}
    per_image = [vision.measure([x])[0].tokens for x in (first, later)]
    assert list(traj.token_ids).count(vision.image_token_id) == per_image[0] + 3 * per_image[1]
    # token-in/token-out: the trainer's forward with all three pictures gives each turn's log-probs
    group = decode_group(encode_group(Group("g", "p", [traj], images=store)))
    batch = batch_from_groups([group])
    mask = batch.loss_mask.bool()
    gap = (TrainEngine(TrainerConfig(model_path=path)).logprobs(batch)[mask] - batch.behavior_logprobs[mask]).abs()
    assert gap.max().item() <= 1e-4, gap.max().item()


def test_a_conversations_pictures_are_bounded_together(served):
    _, engine, tok, vision = served
    image, calls = image_bytes(png(28, 28, 6)), []
    many = Observation("and these?", (image,) * 16)  # each observation within a request's 16, not the two turns
    traj = _run(DigitPicture(image, later=many), _engine_generate(engine, calls), tok, vision, {})
    assert traj.finish_reason == FinishReason.ENV_ERROR and traj.metadata["error_kind"] == "images"
    assert "17 images in the conversation" in traj.metadata["error"] and len(calls) == 1


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
        traj.finish_reason == FinishReason.ENV_ERROR
        and traj.metadata["error"] == "images: 2 image placeholders for 1 images"
    )
    assert not calls
