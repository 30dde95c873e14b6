"""Text generation on the `neuron` device against CPU eager: Hugging Face GPT-2 and Llama, small configs built
from their config classes (random weights, nothing downloaded), `generate()` of greedy tokens.

Side by side in one process, for each model:
  cpu eager          the model on the CPU, warm (after one generate), best of --repeat;
  neuron eager       the model on `neuron`, eager ops, the dynamic cache (every token meets new shapes: the
                     attention's key length grows): cold (the first generate of the process, which compiles
                     each op at each new shape) and warm (the same prompt again: every program cached);
  neuron compiled    `model.forward = torch.compile(model.forward, backend="neuron")` with the static cache
                     (two graphs: prefill and decode): cold (compiles both) and warm.
A cold generate compiles each op at each new shape, or loads it from the compile cache on disk when an earlier
process compiled it (the row says how many of each: run with ``NEURON_CC_FLAGS=--no_cache``, or an empty
``NEURON_COMPILE_CACHE_URL``, for a first-ever run). Prints wall and CPU seconds (the process's own, which the machine's other load does not inflate; the
forked torch-mlir children of a compile are not counted), their ratios to warm CPU eager (the targets: eager
within 20x, compiled within 5x, of the wall time), whether
the tokens equal the CPU's, and the emulated device's tokens/s: the tokens over the device time of one warm
generate (the stream's emulated clock, torch.Event.elapsed_time). Wall times on a shared machine vary with
its load; the ratios are measured side by side. PyTorch and numpy run one thread: on the shared 2-core machine
two intra-op threads contend with the other processes and make CPU eager's generate 5-7x slower, which would
flatter the device.

    .venv/bin/python -m benchmarks.generate [--tokens 32] [--models gpt2,llama] [--repeat 3] [--eager-only]
(needs transformers: pip install -e '.[bench]')
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported: see the docstring
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402


def build(name: str, layers: int, width: int):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=512, n_positions=256,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def timed(fn) -> tuple:
    """(wall seconds, CPU seconds of this process, the tokens on the host)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    if result.device.type == "neuron":
        result = result.cpu()  # the generate is over when its tokens are on the host
    return time.perf_counter() - start, time.process_time() - cpu, result


def device_seconds(fn) -> float:
    """The emulated device time of ``fn`` on the current stream (its launches' estimated durations)."""
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def run(name: str, options) -> list:
    from neuronc.pytorch import backend, eager

    model = build(name, options.layers, options.width)
    prompt = torch.randint(1, 512, (1, options.prompt))
    settings = dict(max_new_tokens=options.tokens, min_new_tokens=options.tokens, do_sample=False, pad_token_id=0)
    rows = []

    def best(fn) -> tuple:
        runs = [timed(fn) for _ in range(options.repeat)]
        return min(r[0] for r in runs), min(r[1] for r in runs), runs[0][2]

    with torch.no_grad():
        model.generate(prompt, **settings)  # warm-up
        cpu_s, cpu_cpu, expected = best(lambda: model.generate(prompt, **settings))
        rows.append((name, "cpu eager (warm)", cpu_s, cpu_cpu, cpu_s, cpu_cpu, True, None))

        on_device = model.to("neuron")
        device_prompt = prompt.to("neuron")
        eager.programs.clear()  # cold: nothing compiled by the models before this one
        before = dict(eager.compile_stats)
        cold, cold_cpu, tokens = timed(lambda: on_device.generate(device_prompt, **settings))
        made = {how: n - before.get(how, 0) for how, n in eager.compile_stats.items()}
        programs = f"{made.get('lowered', 0) + made.get('traced', 0)} programs" + (
            f", {made['disk cache']} from disk" if made.get("disk cache") else "")
        warm, warm_cpu, _ = best(lambda: on_device.generate(device_prompt, **settings))
        device_s = device_seconds(lambda: on_device.generate(device_prompt, **settings))
        same = torch.equal(tokens, expected)
        rows.append((name, f"neuron eager, cold ({programs})", cold, cold_cpu, cpu_s, cpu_cpu, same, None))
        rows.append((name, "neuron eager, warm", warm, warm_cpu, cpu_s, cpu_cpu, same, options.tokens / device_s))

        if options.eager_only:
            return rows
        graphs = backend.compile_count()
        on_device.generation_config.cache_implementation = "static"
        on_device.forward = torch.compile(on_device.forward, backend="neuron")
        cold, cold_cpu, tokens = timed(lambda: on_device.generate(device_prompt, **settings))
        graphs = backend.compile_count() - graphs
        warm, warm_cpu, _ = best(lambda: on_device.generate(device_prompt, **settings))
        device_s = device_seconds(lambda: on_device.generate(device_prompt, **settings))
        same = torch.equal(tokens, expected)
        rows.append((name, f"neuron compiled+static, cold ({graphs} graphs)", cold, cold_cpu, cpu_s, cpu_cpu, same,
                     None))
        rows.append((name, "neuron compiled+static, warm", warm, warm_cpu, cpu_s, cpu_cpu, same,
                     options.tokens / device_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--eager-only", action="store_true",
                        help="only the CPU and neuron eager rows (the compiled rows' cold compile takes minutes)")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"generate() of {options.tokens} tokens after a {options.prompt}-token prompt, {options.layers} layers, "
          f"width {options.width}, greedy")
    print(f"{'model':6} {'run':44} {'wall s':>7} {'/ cpu':>7} {'cpu s':>7} {'/ cpu':>7} {'tokens = cpu':>13} "
          f"{'device tokens/s':>16}")
    for name in options.models.split(","):
        for model, what, wall, cpu, peer_wall, peer_cpu, same, rate in run(name, options):
            print(f"{model:6} {what:44} {wall:7.2f} {wall / peer_wall:6.2f}x {cpu:7.2f} {cpu / peer_cpu:6.2f}x "
                  f"{str(same):>13} {'' if rate is None else f'{rate:,.0f}':>16}")


if __name__ == "__main__":
    main()
