"""Hypothesis: the upstream-block ⇄ ds4jax-layout converters are lossless for any shape and any bytes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ds4jax.quant import rocmfp2, rocmfp2_mix, rocmfp3, rocmfp3_mix

MODULES = [rocmfp2, rocmfp3, rocmfp2_mix, rocmfp3_mix]
LEAD = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


@st.composite
def block_arrays(draw):
  module = draw(st.sampled_from(MODULES))
  shape = (*draw(LEAD), draw(st.integers(1, 4)), draw(st.integers(1, 5)), module.BYTES_PER_BLOCK)
  return module, draw(hnp.arrays(np.uint8, shape))


@st.composite
def plane_arrays(draw):
  module = draw(st.sampled_from(MODULES))
  weight_shape = (*draw(LEAD), draw(st.integers(1, 4)), module.IN_MULTIPLE * draw(st.integers(1, 3)))
  shapes = module.storage_shapes(weight_shape)
  planes = [draw(hnp.arrays(np.uint8, shapes[n])) for n in shapes if n not in ("books", "mode")]
  return module, planes


@settings(max_examples=60, deadline=None)
@given(block_arrays())
def test_blocks_to_planes_to_blocks(case):
  module, blocks = case
  planes = module.from_blocks(blocks)
  assert all(p.dtype == np.uint8 for p in planes)
  np.testing.assert_array_equal(module.to_blocks(*planes), blocks)


@settings(max_examples=60, deadline=None)
@given(plane_arrays())
def test_planes_to_blocks_to_planes(case):
  module, planes = case
  blocks = module.to_blocks(*planes)
  assert blocks.shape[-1] == module.BYTES_PER_BLOCK and blocks.shape[:-2] == planes[0].shape[:-1]
  for got, want in zip(module.from_blocks(blocks), planes):
    np.testing.assert_array_equal(got, want)
