"""``rollmesh serve NAME``: one service in the foreground (what containers and the launcher run)."""

from __future__ import annotations

from pathlib import Path

import typer

from launch.commands.common import ConfigOpt, SetOpt, load_or_exit, setup_logging

app = typer.Typer(no_args_is_help=True, help="Run one service in the foreground (what containers run).")


# rollmesh serve NAME: (module with serve(...), what of the run config it takes, help). Each service takes its own
# typed section, the credentials, and the few values it shares with the run (the mesh's addresses, the policy's
# model path, a deadline another section owns): never the whole config, so what it reads is in its signature.
SERVICES = {
    "engine": (
        "services.engine.server",
        lambda c: (c.engine, c.auth),
        "The engine server of engine.type (embedded, vllm, sglang, sim).",
    ),
    "llm-proxy": (
        "services.llm_proxy.server",
        lambda c: (c.proxy, c.auth),
        "The LLMProxy gRPC service in front of the engines.",
    ),
    "sample-buffer": ("services.sample_buffer.server", lambda c: (c.buffer, c.auth), "The SampleBuffer gRPC service."),
    "controller": (
        "services.controller.server",
        lambda c: (c.controller, c.auth, c.mesh),
        "The AsyncController: admission, weight updates.",
    ),
    "env-manager": (
        "services.env_manager.server",
        lambda c: (c.env_manager, c.auth, c.mesh, c.buffer.put_timeout_s),
        "An EnvManager pool running episodes.",
    ),
    "gateway": (
        "services.gateway.main",
        lambda c: (c.gateway, c.auth, c.mesh, c.model_path, c.buffer.put_timeout_s),
        "The OpenAI-compatible agent gateway: sessions become trained groups.",
    ),
    "trainer": (
        "services.trainer.main",
        lambda c: (
            c.train_loop,
            c.trainer,
            c.auth,
            c.mesh,
            c.controller.groups_per_step,
            c.controller.async_ratio,
            c.devices.placement == "colocated",
        ),
        "The trainer process: train, publish, checkpoint; exits when done.",
    ),
    "reward": (
        "services.reward.server",
        lambda c: (c.reward_service, c.auth, c.mesh.proxy, c.model_path),
        "The reward service: one verifier pool scoring answers for the mesh.",
    ),
    "tinker": (
        "services.tinker.server",
        lambda c: (c.tinker, c.auth, c.model_path, c.engine, c.trainer.device, c.run.startup_timeout_s),
        "The Tinker training API (LoRA on model_path) for the tinker SDK.",
    ),
}


# Services whose callers hold keys of their own (no mesh token to check): the Tinker API makes its
# engine's token itself when it starts one.
OWN_KEYS = {"tinker"}


def service_config(config: Path | None, overrides: list[str], provider: bool = False, mesh_token: bool = True):
    """The run config of a service about to start; exit 2 if it has no token to check calls against
    (an environment provider: its own, ``env_provider.token_env``; ``mesh_token`` False: none needed)."""
    cfg = load_or_exit(config, overrides)
    setup_logging()
    from services.auth import AuthError, Role, provider_auth

    try:  # no token: refuse before anything starts listening
        if provider:
            provider_auth(cfg.auth, cfg.env_provider.token_env)
        elif mesh_token and not (cfg.auth.holds(Role.DATA) or cfg.auth.holds(Role.CONTROL)):
            cfg.auth.bearer()  # raises, naming the variable to set
    except AuthError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    return cfg


def _register_serve(name: str, module: str, args, doc: str) -> None:
    def command(config: Path = ConfigOpt, set_: list[str] = SetOpt) -> None:
        cfg = service_config(config, set_, mesh_token=name not in OWN_KEYS)
        import importlib

        from services.auth import AuthError

        service = importlib.import_module(module)
        try:
            service.serve(*args(cfg))
        except AuthError as e:  # a credential it needs is missing (the gateway's key file): say so, exit 2
            typer.echo(f"config error: {e}", err=True)
            raise typer.Exit(2) from None

    command.__doc__ = doc
    app.command(name)(command)


for _name, (_module, _args, _doc) in SERVICES.items():
    _register_serve(_name, _module, _args, _doc)


@app.command("env-provider")
def serve_env_provider(
    config: Path = ConfigOpt,
    set_: list[str] = SetOpt,
    env: str | None = typer.Option(
        None, "--env", help="The environment to host: a type (single_turn, sim, calculator) or 'module:Class'."
    ),
) -> None:
    """An environment provider: hosts an environment over gRPC and OpenEnv's HTTP (env_provider section)."""
    if env is not None:
        set_ = [
            *(
                [f"env_provider.env.type={env}"]
                if ":" not in env
                else ["env_provider.env.type=custom", f"env_provider.env.cls={env}"]
            ),
            *set_,
        ]
    cfg = service_config(config, set_, provider=True)
    from services.env_provider.server import serve

    try:
        serve(cfg.env_provider, cfg.auth, cfg.mesh.reward)
    except (OSError, ValueError) as e:  # a dataset that is not there, a port taken, an environment that refuses
        typer.echo(f"env-provider: {e}", err=True)
        raise typer.Exit(2) from None
