//! Graph replay vs the same kernels launched one by one, and an exec update check vs
//! re-capture + instantiate. Same process, same kernels, variants in paired rounds.

mod common;

use std::sync::Arc;

use common::{criterion, gpu, seconds, Ratio, Recorder, Variants};
use stablebuf::kernels::MatmulKernel;
use stablebuf::{Layout, Space, StableGraph};

const LAUNCH: &str = "replay vs stream launches (64x64 matmul kernels)";
const UPDATE: &str = "update check vs re-capture + instantiate";

fn main() {
    let Some(gpu) = gpu() else { return };
    let rec = Recorder::default();
    let mut c = criterion();
    let n = 64usize;
    let layout = Layout::builder()
        .group("in")
        .input("a", n * n * 4)
        .input("b", n * n * 4)
        .scratch("c", n * n * 4)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let data = space.new_dataset("in").unwrap();
    data.write(&gpu.stream, "a", &vec![0.5f32; n * n]).unwrap();
    data.write(&gpu.stream, "b", &vec![0.25f32; n * n]).unwrap();
    space.bind(&data).unwrap();
    let (a, b, cc) = (
        space.slot("a").unwrap().clone(),
        space.slot("b").unwrap().clone(),
        space.slot("c").unwrap().clone(),
    );
    let mut rows = Vec::new();
    for kernels_in_graph in [1usize, 100, 1000] {
        let row = format!("K={kernels_in_graph}");
        rows.push(row.clone());
        let work = {
            let (a, b, cc, k) = (a.clone(), b.clone(), cc.clone(), gpu.kernels.clone());
            move |s: &Arc<_>| {
                for _ in 0..kernels_in_graph {
                    k.matmul(s, MatmulKernel::Tiled, &a, &b, &cc, n, n, n)?;
                }
                Ok(())
            }
        };
        let graph = std::cell::RefCell::new(space.capture(&gpu.stream, work.clone()).unwrap());
        let mut group = c.benchmark_group(LAUNCH);
        Variants::new(LAUNCH)
            .add("stream", || {
                seconds(|| {
                    work.clone()(&gpu.stream).unwrap();
                    gpu.stream.synchronize().unwrap();
                })
            })
            .add("replay", || {
                seconds(|| {
                    graph.borrow().replay().unwrap();
                    gpu.stream.synchronize().unwrap();
                })
            })
            .bench(&mut group, &rec, &row);
        group.finish();
        let mut group = c.benchmark_group(UPDATE);
        Variants::new(UPDATE)
            .add("update-check", || {
                seconds(|| assert!(graph.borrow_mut().check_update().unwrap().is_success()))
            })
            .add("recapture", || {
                seconds(|| {
                    drop(StableGraph::capture(&gpu.stream, &[&space], work.clone()).unwrap())
                })
            })
            .bench(&mut group, &rec, &row);
        group.finish();
    }
    c.final_summary();
    rec.paired_table(
        LAUNCH,
        &["stream", "replay"],
        &rows,
        "µs, launch + sync",
        1e6,
        &[Ratio::of("stream", "replay")],
    );
    rec.paired_table(
        UPDATE,
        &["update-check", "recapture"],
        &rows,
        "µs",
        1e6,
        &[Ratio::of("recapture", "update-check")],
    );
}
