import plait


def test_demo_spec_streams(demo_spec_path):
    spec = plait.load_spec(demo_spec_path)
    loader = plait.Loader(spec, dp_rank=0, steps=2)
    batches = list(loader)
    assert len(batches) == 2 * spec.packing.num_microbatches
    assert all(b.cu_seqlens[-1] == len(b.input_ids) for b in batches)
