"""The committed stubs under services/pb must be what `make proto` generates from proto/."""

from pathlib import Path

from services.protogen import OUT_DIR, generate


def test_generated_stubs_match_proto_files(tmp_path):
    fresh = generate(tmp_path / "pb")
    for f in fresh:
        committed = OUT_DIR / f.relative_to(tmp_path / "pb")
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert committed.read_text() == f.read_text(), f"{committed} is out of date with proto/: run `make proto`"
    extra = {p.name for p in (OUT_DIR / "rollmesh" / "v1").glob("*_pb2*")} - {f.name for f in fresh}
    assert not extra, f"stale generated files without a .proto: {extra}"


def test_all_five_services_have_contracts():
    from services.pb.rollmesh.v1 import (
        controller_pb2,
        env_manager_pb2,
        env_provider_pb2,
        llm_proxy_pb2,
        sample_buffer_pb2,
    )

    services = {
        "LLMProxy": (
            llm_proxy_pb2,
            {
                "Generate",
                "GenerateGroup",
                "GenerateStream",
                "Abort",
                "Suspend",
                "Resume",
                "UpdateWeights",
                "UpdateWeightsBucket",
                "InitWeightsGroup",
                "UpdateWeightsDistributed",
                "ReleaseMemory",
                "ResumeMemory",
                "ScoreTokens",
                "Stats",
            },
        ),
        "EnvManager": (env_manager_pb2, {"Start", "Stop", "Stats"}),
        "EnvProvider": (env_provider_pb2, {"Describe", "Reset", "Step", "Close"}),
        "SampleBuffer": (sample_buffer_pb2, {"Put", "Get", "Ack", "Requeue", "Stats"}),
        "AsyncController": (
            controller_pb2,
            {"Admit", "Release", "BeginUpdate", "CommitUpdate", "AbortUpdate", "WatchVersion"},
        ),
    }
    for name, (mod, rpcs) in services.items():
        svc = mod.DESCRIPTOR.services_by_name[name]
        assert {m.name for m in svc.methods} == rpcs, name
    assert Path("proto/rollmesh/v1/common.proto").exists()
