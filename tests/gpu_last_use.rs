//! `FencePolicy::LastUse`: a bind waits only up to the last noted use of the memory, so it
//! overlaps work queued after that use (the next step's replay over another region), and still
//! never unmaps memory a noted use is reading. Compared with the `Context` policy, which waits
//! for the whole device.

mod common;

use std::time::{Duration, Instant};

use common::{gpu, random_vec, rng};
use stablebuf::region::{Region, RegionOptions};
use stablebuf::{DeviceBuffer, FencePolicy};

const WORDS: usize = 4 << 20; // 16 MiB of f32

struct Raw(u64, usize);

impl DeviceBuffer for Raw {
    fn device_address(&self) -> stablebuf::cudarc::driver::sys::CUdeviceptr {
        self.0
    }
    fn byte_len(&self) -> usize {
        self.1
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_last_use_bind_overlaps_later_work_and_never_unmaps_under_a_noted_use() {
    let g = gpu();
    let mut rng = rng("last_use");
    let spin = Duration::from_millis(80);
    for policy in [FencePolicy::LastUse, FencePolicy::Context] {
        let region = Region::new(
            &g.ctx,
            &format!("w-{policy:?}"),
            RegionOptions::default().fence(policy),
        )
        .unwrap();
        let address = region.alloc(WORDS * 4).unwrap();
        let a = random_vec(&mut rng, WORDS);
        let b = random_vec(&mut rng, WORDS);
        region.write(&g.stream, address, &a).unwrap();
        let set_a = region.snapshot(&g.stream).unwrap();
        region.write(&g.stream, address, &b).unwrap();
        let set_b = region.snapshot(&g.stream).unwrap();
        let stream = g.stream.cu_stream() as u64;

        // A noted use that is still running: spin, then transform the region in place. The
        // bind must wait for it (else it would unmap memory the kernel is about to write).
        region.bind(&set_a).unwrap();
        g.kernels.spin(&g.stream, spin).unwrap();
        g.kernels
            .affine(&g.stream, &Raw(address, WORDS * 4), 2.0, 0.5)
            .unwrap();
        region.note_use(stream).unwrap();
        let start = Instant::now();
        region.bind(&set_b).unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= spin / 2,
            "{policy:?}: the bind returned after {waited:?}, before the noted use could finish"
        );
        region.bind(&set_a).unwrap();
        let mut got = vec![f32::NAN; WORDS];
        region.read_into(&g.stream, address, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&a).enumerate() {
            let want = 2.0 * w + 0.5;
            assert!(
                approx::relative_eq!(*g, want, max_relative = 1e-6),
                "{policy:?}: element {i} of set A after its noted use: {g} vs {want}"
            );
        }

        // Work queued after the last noted use, not touching the region: only LastUse binds
        // without waiting for it.
        region.note_use(stream).unwrap();
        g.kernels.spin(&g.stream, spin).unwrap();
        let start = Instant::now();
        region.bind(&set_b).unwrap();
        let waited = start.elapsed();
        g.stream.synchronize().unwrap();
        match policy {
            FencePolicy::LastUse => assert!(
                waited < spin / 2,
                "LastUse: the bind waited {waited:?} for work after the last use"
            ),
            _ => assert!(
                waited >= spin / 2,
                "{policy:?}: the bind waited only {waited:?} for the device"
            ),
        }
        let mut got = vec![f32::NAN; WORDS];
        region.read_into(&g.stream, address, &mut got).unwrap();
        assert_eq!(got, b, "{policy:?}: set B after the overlapped bind");
        println!("{policy:?}: a bind after later unrelated work waited {waited:?}");
    }
}
