"""The board install has no torch: the runtime and `edgellm run` must work with torch (and onnx, transformers)
made unimportable, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.runtime_fixtures import CHAIN, bigram_export

BLOCKED = ("torch", "onnx", "onnxscript", "onnx_ir", "transformers", "safetensors")

SCRIPT = textwrap.dedent("""
    import json, sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the runtime must not import it")
            return None

    sys.meta_path.insert(0, Blocker())
    from edgellm.runtime import Generator
    from edgellm.runtime.sampling import SamplingParams, StopParams

    gen = Generator.open(sys.argv[1], threads=1)
    result = gen.complete("a", SamplingParams(temperature=0), StopParams(max_new_tokens=16))
    from edgellm.cli import main
    code = main(["run", sys.argv[1], "--prompt", "a", "--temperature", "0", "--json", "--threads", "1"])
    print(json.dumps({"text": result.text, "reason": result.finish_reason, "code": code,
                      "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
""")


def test_generate_and_cli_without_torch(tmp_path_factory):
    directory = bigram_export(tmp_path_factory)
    code = f"BLOCKED = {BLOCKED!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cli_line, own_line = proc.stdout.strip().splitlines()[-2:]
    own = json.loads(own_line)
    assert own == {"text": CHAIN, "reason": "eos", "code": 0, "loaded": []}
    cli = json.loads(cli_line)
    assert (cli["schema"], cli["text"], cli["finish_reason"]) == ("edgellm-run", CHAIN, "eos")
