"""Prints parameter counts by component, computed from the config: `python -m experiments.param_counts`."""

from absl import app, flags

from ds4jax import config

_PRESETS = flags.DEFINE_list("presets", ["v4_flash", "v4_pro"], "Presets to count.")


def main(argv):
  del argv
  cfgs = [config.preset(p) for p in _PRESETS.value]
  counts = [c.param_counts() for c in cfgs]
  print(f"{'component':<20}" + "".join(f"{c.name:>14}" for c in cfgs))
  for key in counts[0]:
    print(f"{key:<20}" + "".join(f"{config.human(n[key]):>14}" for n in counts))


if __name__ == "__main__":
  app.run(main)
