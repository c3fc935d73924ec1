"""What the benches read off a running mesh: /metrics pages (the engines' running sequences, the
EnvManagers' stale tokens, member fates and kept lengths) and the SampleBuffer's stats."""

from __future__ import annotations


def scrape(url: str) -> dict[str, float]:
    """A /metrics page's samples by name (labels summed); empty when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def running_sequences(engine_urls: list[str]) -> float:
    """Sequences in the engines' running batches now (paused engines count as idle)."""
    total = 0.0
    for url in engine_urls:
        values = scrape(url)
        if values.get("rollmesh_engine_paused", 0.0) == 0:
            total += values.get("rollmesh_engine_running_requests", 0.0)
    return total


def stale_token_share(env_manager_targets: list[str]) -> float | None:
    """Share of the EnvManagers' generated tokens (every ended episode's, stale groups' included)
    that went to groups stopped as too stale."""
    stale = generated = 0.0
    for target in env_manager_targets:
        values = scrape(f"http://{target}")
        stale += values.get("rollmesh_env_stale_tokens_total", 0.0)
        generated += values.get("rollmesh_env_generated_tokens_total", 0.0)
    return round(stale / generated, 3) if generated else None


def member_fates(env_manager_targets: list[str]) -> dict:
    """Redundant rollout's price and bias, from the EnvManagers' metrics: the share of generated tokens
    that went to members cancelled when their group was full, and the mean generated tokens of a kept
    member (against a run without redundancy: the bias toward episodes that end sooner)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for target in env_manager_targets:
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=2).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                label = sample.labels.get("fate") or sample.labels.get("cause") or ""
                key = f"{sample.name}:{label}"
                sums[key] = sums.get(key, 0.0) + sample.value
    generated = sums.get("rollmesh_env_generated_tokens_total:", 0.0)
    kept_n = sums.get("rollmesh_env_member_generated_tokens_count:kept", 0.0)
    return {
        "redundant_token_share": round(
            sums.get("rollmesh_env_dropped_member_tokens_total:redundant", 0.0) / generated, 3
        )
        if generated
        else None,
        "members_cancelled": sums.get("rollmesh_env_members_dropped_total:redundant", 0.0),
        "members_timed_out": sums.get("rollmesh_env_members_dropped_total:timeout", 0.0),
        "kept_member_mean_tokens": round(sums.get("rollmesh_env_member_generated_tokens_sum:kept", 0.0) / kept_n, 1)
        if kept_n
        else None,
    }


LENGTH_BUCKETS = (1024, 4096, 16384)  # kept members' generated tokens (edges of TOKEN_BUCKETS)


def kept_length_buckets(env_manager_targets: list[str]) -> dict[str, float] | None:
    """Share of the members put in the buffer (trained) by generated length, from the EnvManagers'
    ``rollmesh_env_member_generated_tokens{fate="kept"}`` histogram (whole run)."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[float, float] = {}
    for target in env_manager_targets:
        text = scrape_text(f"http://{target}")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "rollmesh_env_member_generated_tokens_bucket" and sample.labels["fate"] == "kept":
                    le = float(sample.labels["le"])
                    cumulative[le] = cumulative.get(le, 0.0) + sample.value
    total = cumulative.get(float("inf"), 0.0)
    if not total:
        return None
    out, below = {}, 0.0
    for edge in LENGTH_BUCKETS:
        upto = max((v for le, v in cumulative.items() if le <= edge), default=0.0)
        out[f"<={edge}"] = round((upto - below) / total, 3)
        below = upto
    out[f">{LENGTH_BUCKETS[-1]}"] = round((total - below) / total, 3)
    return out


def scrape_text(url: str) -> str:
    import httpx

    try:
        return httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


def buffer_stats(address: str) -> dict:
    import asyncio

    from services.sample_buffer.client import BufferClient

    async def go():
        client = BufferClient(address, timeout_s=10)
        try:
            s = await client.stats()
            return {"consumed": s.consumed_total, **dict(s.dropped_by_reason)}
        finally:
            await client.close()

    return asyncio.run(go())
