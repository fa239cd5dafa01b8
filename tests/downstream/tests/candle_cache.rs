//! A candle engine's cache named through the facade alone (`kvlink = { features =
//! ["candle"] }`): a sequence's latent cache waits for each layer of the mock's load, then reads
//! it as a tensor.

use std::sync::Arc;

use kvlink::candle::candle_core::{DType, Device, Tensor};
use kvlink::candle::{LatentFormat, LatentPool, LayerGate, PagedLatentCache};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, LoadHandle, LookupRequest, RequestPages};
use kvlink::mock::{MockKvLoader, MockScript, MOCK_PAGE_SIZE};

#[test]
fn a_cache_through_the_facade_waits_for_the_mocks_load_then_reads_each_layer() {
    let layers = 3;
    let format = LatentFormat::new(32, 16, DType::F32).unwrap();
    let k = ComponentSpec::new(
        "k",
        RowUnit::Token,
        ElementType::Bytes,
        format.row_bytes() as u32,
    );
    let spec = ModelKvSpec::new("tiny-mla", layers, MOCK_PAGE_SIZE, vec![k]).unwrap();
    let pool = Arc::new(HostKvPool::new(KvGeometry::new(spec.clone(), 1, 0).unwrap(), 4).unwrap());
    let latents = LatentPool::new(pool, "k", format, Device::Cpu).unwrap();

    let mock = Arc::new(MockKvLoader::new(layers, MockScript::default()));
    let loader: Arc<dyn KvLoader> = mock.clone();
    let tokens: Vec<u32> = (0..2 * MOCK_PAGE_SIZE).collect();
    let hit = loader
        .lookup(&LookupRequest {
            tokens: &tokens,
            skip_pages: 0,
        })
        .unwrap();
    assert_eq!(hit.pages.len(), 2);
    let requests = vec![RequestPages {
        request: "r".into(),
        pages: hit.pages,
    }];
    let geometry = KvGeometry::new(spec, 1, 0).unwrap();
    let plan = BatchPlan::all_components(&geometry, BatchId(1), requests, vec![3, 1]);
    let load = LoadHandle::start(loader, plan).unwrap();
    // SAFETY: slots 3, 1 and 0 are this sequence's alone; only its own load writes 3 and 1.
    let mut cache = unsafe { PagedLatentCache::new(latents, vec![3, 1, 0], hit.tokens) }
        .with_load(LayerGate::from_handle(load));
    let n = hit.tokens;
    for layer in 0..layers {
        assert_eq!(cache.layer(layer, n).unwrap().dims(), &[n, 48]);
        // The suffix's freshly computed row goes back after the cached ones (slot 0).
        let fresh = Tensor::full(layer as f32 + 1., (1, 48), &Device::Cpu).unwrap();
        cache.write(layer, n, &fresh).unwrap();
        let back = cache.layer(layer, n + 1).unwrap().narrow(0, n, 1).unwrap();
        let diff = (back - &fresh).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    }
    assert!(cache.finish_load().unwrap().is_some());
}
