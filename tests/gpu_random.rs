//! Random sequences of operations, checked step by step against a CPU model.
//!
//! A seeded generator (seed printed; `STABLEBUF_SEED` replays it, `STABLEBUF_STEPS` sets the
//! length, 10,000 by default) drives spaces, datasets, binds (remap and copy-in, with and
//! without a stream), captures, replays, update checks, offload and restore (pinned arena,
//! staged through it, pageable, discarded), space sleep and wake, copy-out, drops, an elastic
//! pool (tenant churn, a limited tenant, alloc, grow, shrink, free, graft, drain, stitching on
//! and off) and regions (alloc, free, write, read, sleep and wake through each storage,
//! snapshots, binds, unbinds, the replay guard). The model predicts, for every step, the result
//! or the exact error variant, what each group has bound, the bytes a replay writes (checked on
//! the GPU: the copied pattern and the `a·y + b` values), pool and region statistics; at
//! quiet points every known byte is checked and the device's free memory must match the
//! memory the model says is held. Everything dropped at the end must give all of it back.
//!
//! On a mismatch the test prints the seed, the step and the last operations.

mod common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::leaks::{free_memory, free_memory_counting_held, MIB};
use common::patterns::DeviceRange;
use common::{gpu, rng, Gpu};
use rand::rngs::StdRng;
use rand::Rng;
use stablebuf::error::{
    DriverError, GraphError, LayoutError, OffloadError, PoolError, RegionError,
};
use stablebuf::host::StorageUsed;
use stablebuf::pool::{Block, Tenant};
use stablebuf::region::{Region, RegionOptions, Snapshot, SwitchStrategy, Switched};
use stablebuf::{
    buffer, BindStrategy, Dataset, DeviceBuffer, ElasticPool, Error, FencePolicy, HostArena,
    HostStorage, Layout, PoolOptions, Space, SpaceOptions, StableGraph,
};

const W_BYTES: usize = 3 * MIB + 4;
const X_BYTES: usize = MIB;
const Y_BYTES: usize = 64 << 10;
const T_BYTES: usize = MIB;
const W: usize = 0;
const X: usize = 1;
const GROUPS: [&str; 2] = ["w", "x"];
const ARENA_BYTES: usize = 14 * MIB;
const REGION_CAPACITY: usize = 128 * MIB;
/// Device memory the driver may hold or give back on its own between two quiet points.
const MEMORY_SLACK: usize = 6 * MIB;

fn layout() -> Layout {
    Layout::builder()
        .group("w")
        .input("w", W_BYTES)
        .group("x")
        .input("x", X_BYTES)
        .output("y", Y_BYTES)
        .scratch("t", T_BYTES)
        .build()
        .unwrap()
}

/// The pattern `Kernels::fill_pattern` writes (kernels/matmul.cu), for checks on the host.
fn pattern(i: u64, seed: u32) -> u32 {
    let s = u64::from(seed);
    let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (s << 32 | s);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x as u32 | 1
}

// ------------------------------------------------------------------------------- the model

/// What a step must return.
#[derive(Clone, Debug, PartialEq)]
enum Want {
    Ok,
    Unbound(String),
    Asleep,
    Offloaded(u64),
    RegionAsleep,
    SnapshotMismatch,
    TenantGone,
    BeyondCapacity,
    InvalidShape,
    OverBudget,
    UnknownAllocation,
}

fn is(error: &Error, want: &Want) -> bool {
    match (error, want) {
        (Error::Graph(GraphError::Unbound { group }), Want::Unbound(g)) => group == g,
        (Error::Graph(GraphError::Asleep), Want::Asleep) => true,
        (Error::Offload(OffloadError::Offloaded { dataset }), Want::Offloaded(id)) => dataset == id,
        (Error::Region(RegionError::RegionAsleep { .. }), Want::RegionAsleep) => true,
        (Error::Region(RegionError::SnapshotMismatch { .. }), Want::SnapshotMismatch) => true,
        (Error::Pool(PoolError::TenantGone { .. }), Want::TenantGone) => true,
        (Error::Pool(PoolError::BeyondCapacity { .. }), Want::BeyondCapacity) => true,
        (Error::Layout(LayoutError::InvalidShape(_)), Want::InvalidShape) => true,
        (Error::Pool(PoolError::OverBudget { .. }), Want::OverBudget) => true,
        (Error::Region(RegionError::UnknownAllocation { .. }), Want::UnknownAllocation) => true,
        _ => false,
    }
}

type Step<T> = std::result::Result<T, String>;

/// Errors that came as the model predicted.
static EXPECTED_ERRORS: AtomicUsize = AtomicUsize::new(0);

/// `Ok(Some(value))` when success was wanted and came, `Ok(None)` when the wanted error came.
fn expect<T>(got: stablebuf::Result<T>, want: &Want) -> Step<Option<T>> {
    match (got, want) {
        (Ok(value), Want::Ok) => Ok(Some(value)),
        (Err(error), want) if is(&error, want) => {
            EXPECTED_ERRORS.fetch_add(1, Ordering::Relaxed);
            Ok(None)
        }
        (Ok(_), want) => Err(format!("succeeded; the model expected {want:?}")),
        (Err(error), want) => Err(format!("returned {error:?}; the model expected {want:?}")),
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// A dataset and what the model knows of its contents.
struct Ds {
    d: Dataset,
    group: usize,
    /// Pattern seeds of slots w (group w) or x (group x), and the value of every y.
    w: Option<u32>,
    x: Option<u32>,
    y: Option<f32>,
    /// Where the bytes are while offloaded: `Some(footprint)` in the pinned arena.
    offloaded: Option<Option<usize>>,
}

struct Sp {
    s: Space,
    copy_in: bool,
    bound: [Option<u64>; 2],
    /// While asleep: what each group had bound at sleep.
    sleeping: Option<[Option<u64>; 2]>,
    /// A copy-in group's own memory: the x pattern last copied in, the y values.
    res_x: Option<u32>,
    res_y: Option<f32>,
}

struct Gr {
    g: StableGraph,
    space: u64,
    a: f32,
    b: f32,
}

struct Ten {
    t: Tenant,
    key: u32,
    limit: Option<usize>,
}

struct Blk {
    b: Block,
    tenant: u32,
    len: usize,
    capacity: usize,
    seed: u32,
    /// Leading `u32`s holding the pattern of `seed`.
    known: usize,
    gone: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Alloc {
    asked: usize,
    rounded: usize,
    seed: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    bytes: usize,
    /// The snapshot under the span, if the test knows it (bound by the test, or kept).
    id: Option<u64>,
}

struct Reg {
    r: Region,
    allocs: BTreeMap<usize, Alloc>,
    asleep: bool,
    unbound: bool,
    consolidated: usize,
    span: Option<Span>,
    pieces: BTreeMap<usize, usize>,
    /// While asleep: the arena bytes held, and whether the contents were discarded.
    arena_footprint: usize,
    discarded: bool,
    /// The region's own weight set for copy switches, `(id, bytes)`, while it holds one: made
    /// by the first copy switch, let go by a sleep, an unbind, or a snapshot it is too short for.
    live: Option<(u64, usize)>,
}

/// A snapshot the test holds; `frozen` is its contents when it is not under a live region
/// (under one, the region's contents are its contents).
struct Snap {
    s: Snapshot,
    region: u64,
    frozen: Option<BTreeMap<usize, Alloc>>,
}

struct Fixed {
    gpu: Gpu,
    arena: Arc<HostArena>,
    /// Makes datasets; never bound, never asleep.
    factory: Space,
    group_bytes: [usize; 2],
    scratch_bytes: usize,
    granularity: usize,
}

struct World {
    fx: Fixed,
    rng: StdRng,
    datasets: Vec<Ds>,
    spaces: Vec<Sp>,
    graphs: Vec<Gr>,
    pool: ElasticPool,
    tenants: Vec<Ten>,
    blocks: Vec<Blk>,
    next_tenant: u32,
    regions: Vec<Reg>,
    snaps: Vec<Snap>,
    next_region: u32,
    counts: BTreeMap<String, usize>,
}

fn footprint(bytes: usize) -> usize {
    bytes.div_ceil(4096) * 4096
}

fn range(ptr: u64, bytes: usize) -> DeviceRange {
    DeviceRange { ptr, bytes }
}

impl World {
    fn g(&self) -> &Gpu {
        &self.fx.gpu
    }

    fn round(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.fx.granularity) * self.fx.granularity
    }

    fn errors(&self, buffer: &impl DeviceBuffer, count: usize, seed: u32) -> u64 {
        self.g()
            .kernels
            .pattern_mismatches(&self.g().stream, buffer, 0, count, seed)
            .expect("pattern_mismatches")
    }

    fn fill(&self, buffer: &impl DeviceBuffer, count: usize, seed: u32) -> Step<()> {
        self.g()
            .kernels
            .fill_pattern(&self.g().stream, buffer, 0, count, seed)
            .map_err(|e| format!("fill_pattern: {e}"))?;
        self.g().stream.synchronize().map_err(|e| e.to_string())
    }

    fn space_index(&self, id: u64) -> usize {
        self.spaces.iter().position(|s| s.s.id() == id).unwrap()
    }

    fn ds_index(&self, id: u64) -> Option<usize> {
        self.datasets.iter().position(|d| d.d.id() == id)
    }

    fn storage(&mut self, discard: bool) -> HostStorage {
        match self.rng.gen_range(0..if discard { 4 } else { 3 }) {
            0 | 1 => HostStorage::Pinned(self.fx.arena.clone()),
            2 => HostStorage::Pageable,
            _ => HostStorage::Discard,
        }
    }

    // ------------------------------------------------------------- datasets and spaces

    fn new_dataset(&mut self) -> Step<String> {
        let group = self.rng.gen_range(0..2);
        let d = self
            .fx
            .factory
            .new_dataset(GROUPS[group])
            .map_err(|e| e.to_string())?;
        let id = d.id();
        self.datasets.push(Ds {
            d,
            group,
            w: None,
            x: None,
            y: None,
            offloaded: None,
        });
        let i = self.datasets.len() - 1;
        if self.rng.gen_bool(0.9) {
            self.write_dataset_at(i)?;
        }
        Ok(format!("new dataset {id} of group {}", GROUPS[group]))
    }

    fn write_dataset_at(&mut self, i: usize) -> Step<()> {
        let seed: u32 = self.rng.gen();
        let value = self.rng.gen_range(-8i32..8) as f32;
        let ds = &self.datasets[i];
        let want = match ds.offloaded {
            Some(_) => Want::Offloaded(ds.d.id()),
            None => Want::Ok,
        };
        let stream = self.g().stream.clone();
        let (slot, bytes) = if ds.group == W {
            ("w", W_BYTES)
        } else {
            ("x", X_BYTES)
        };
        if let Some(view) = expect(ds.d.view::<u32>(slot, &stream), &want)? {
            self.fill(&view, bytes / 4, seed)?;
            let ds = &mut self.datasets[i];
            if ds.group == W {
                ds.w = Some(seed);
            } else {
                ds.d.write(&stream, "y", &vec![value; Y_BYTES / 4])
                    .map_err(|e| e.to_string())?;
                ds.x = Some(seed);
                ds.y = Some(value);
            }
        }
        Ok(())
    }

    fn check_dataset_at(&self, i: usize) -> Step<()> {
        let ds = &self.datasets[i];
        let stream = &self.g().stream;
        let want = match ds.offloaded {
            Some(_) => Want::Offloaded(ds.d.id()),
            None => Want::Ok,
        };
        let (slot, bytes, seed) = if ds.group == W {
            ("w", W_BYTES, ds.w)
        } else {
            ("x", X_BYTES, ds.x)
        };
        let Some(view) = expect(ds.d.view::<u32>(slot, stream), &want)? else {
            return Ok(());
        };
        if let Some(seed) = seed {
            let bad = self.errors(&view, bytes / 4, seed);
            ensure!(
                bad == 0,
                "dataset {}: {bad} elements of {slot} differ",
                ds.d.id()
            );
        }
        if let (X, Some(value)) = (ds.group, ds.y) {
            let y: Vec<f32> = ds.d.read(stream, "y").map_err(|e| e.to_string())?;
            let bad = y
                .iter()
                .filter(|&&v| v.to_bits() != value.to_bits())
                .count();
            ensure!(
                bad == 0,
                "dataset {}: {bad} values of y are not {value}",
                ds.d.id()
            );
        }
        Ok(())
    }

    fn new_space(&mut self) -> Step<String> {
        let copy_in = self.rng.gen_bool(0.4);
        let fence = if self.rng.gen_bool(0.5) {
            FencePolicy::Context
        } else {
            FencePolicy::AttachedStreams
        };
        let mut options = SpaceOptions::default().fence(fence);
        if copy_in {
            options = options.group_bind("x", BindStrategy::CopyIn);
        }
        let s =
            Space::with_options(&self.fx.gpu.ctx, layout(), options).map_err(|e| e.to_string())?;
        let text = format!(
            "new space {} (x {}, {fence:?})",
            s.id(),
            if copy_in { "copy-in" } else { "remap" }
        );
        self.spaces.push(Sp {
            s,
            copy_in,
            bound: [None, None],
            sleeping: None,
            res_x: None,
            res_y: None,
        });
        Ok(text)
    }

    fn drop_space(&mut self, i: usize) -> String {
        let id = self.spaces[i].s.id();
        self.graphs.retain(|g| g.space != id);
        self.spaces.remove(i);
        format!("drop space {id} and its graphs")
    }

    /// The model's side of a bind that happened.
    fn model_bind(&mut self, si: usize, di: usize) {
        let ds = &self.datasets[di];
        let (id, group, x) = (ds.d.id(), ds.group, ds.x);
        let sp = &mut self.spaces[si];
        if sp.bound[group] == Some(id) {
            return;
        }
        sp.bound[group] = Some(id);
        if group == X && sp.copy_in {
            sp.res_x = x;
        }
    }

    fn bind(&mut self, si: usize, di: usize, on_stream: bool) -> Step<String> {
        let ds = &self.datasets[di];
        let want = match ds.offloaded {
            Some(_) => Want::Offloaded(ds.d.id()),
            None => Want::Ok,
        };
        let sp = &self.spaces[si];
        let got = if on_stream {
            sp.s.bind_on(&ds.d, &self.fx.gpu.stream)
        } else {
            sp.s.bind(&ds.d)
        };
        let text = format!(
            "bind{} dataset {} into space {}",
            if on_stream { "_on" } else { "" },
            ds.d.id(),
            sp.s.id()
        );
        if expect(got, &want)?.is_some() {
            self.model_bind(si, di);
            if on_stream {
                self.g().stream.synchronize().map_err(|e| e.to_string())?;
            }
        }
        self.check_bound(si)?;
        Ok(text)
    }

    fn check_bound(&self, si: usize) -> Step<()> {
        let sp = &self.spaces[si];
        for (g, name) in GROUPS.iter().enumerate() {
            let got = sp.s.bound_dataset(name).map_err(|e| e.to_string())?;
            ensure!(
                got == sp.bound[g],
                "space {} group {name}: bound {got:?}, the model has {:?}",
                sp.s.id(),
                sp.bound[g]
            );
        }
        ensure!(
            sp.s.is_asleep() == sp.sleeping.is_some(),
            "space {}: asleep?",
            sp.s.id()
        );
        Ok(())
    }

    fn unbind(&mut self, si: usize, group: usize) -> Step<String> {
        let sp = &mut self.spaces[si];
        expect(sp.s.unbind(GROUPS[group]), &Want::Ok)?;
        sp.bound[group] = None;
        self.check_bound(si)?;
        Ok(format!(
            "unbind group {} of space {}",
            GROUPS[group],
            self.spaces[si].s.id()
        ))
    }

    /// Where slot `slot` of space `si` reads from: the dataset's contents or the copy-in memory.
    fn slot_contents(&self, si: usize, group: usize) -> (Option<u32>, Option<f32>, Option<usize>) {
        let sp = &self.spaces[si];
        if group == X && sp.copy_in {
            return (sp.res_x, sp.res_y, None);
        }
        let di = sp.bound[group].and_then(|id| self.ds_index(id));
        match di {
            Some(di) => {
                let ds = &self.datasets[di];
                (if group == W { ds.w } else { ds.x }, ds.y, Some(di))
            }
            None => (None, None, None),
        }
    }

    fn write_space(&mut self, si: usize) -> Step<String> {
        let slot = ["w", "x", "y"][self.rng.gen_range(0..3)];
        let group = if slot == "w" { W } else { X };
        let want = match self.spaces[si].bound[group] {
            Some(_) => Want::Ok,
            None => Want::Unbound(GROUPS[group].into()),
        };
        let stream = self.g().stream.clone();
        let seed: u32 = self.rng.gen();
        let value = self.rng.gen_range(-8i32..8) as f32;
        let text = format!("write slot {slot} through space {}", self.spaces[si].s.id());
        let sp = &self.spaces[si];
        let written = if slot == "y" {
            expect(sp.s.write(&stream, "y", &vec![value; Y_BYTES / 4]), &want)?.is_some()
        } else {
            match expect(sp.s.view::<u32>(slot, &stream), &want)? {
                Some(view) => {
                    let count = if slot == "w" { W_BYTES } else { X_BYTES } / 4;
                    self.fill(&view, count, seed)?;
                    true
                }
                None => false,
            }
        };
        if written {
            let copy_in = group == X && self.spaces[si].copy_in;
            let target = self.slot_contents(si, group).2;
            match (slot, copy_in) {
                ("y", true) => self.spaces[si].res_y = Some(value),
                ("x", true) => self.spaces[si].res_x = Some(seed),
                ("y", false) => self.datasets[target.unwrap()].y = Some(value),
                ("x", false) => self.datasets[target.unwrap()].x = Some(seed),
                _ => self.datasets[target.unwrap()].w = Some(seed),
            }
        }
        Ok(text)
    }

    fn check_space(&self, si: usize) -> Step<()> {
        let sp = &self.spaces[si];
        let stream = &self.g().stream;
        for group in [W, X] {
            let want = match sp.bound[group] {
                Some(_) => Want::Ok,
                None => Want::Unbound(GROUPS[group].into()),
            };
            let (seed, y, _) = self.slot_contents(si, group);
            let (slot, bytes) = if group == W {
                ("w", W_BYTES)
            } else {
                ("x", X_BYTES)
            };
            let Some(view) = expect(sp.s.view::<u32>(slot, stream), &want)? else {
                continue;
            };
            if let Some(seed) = seed {
                let bad = self.errors(&view, bytes / 4, seed);
                ensure!(
                    bad == 0,
                    "space {} slot {slot}: {bad} elements differ",
                    sp.s.id()
                );
            }
            if let (X, Some(value)) = (group, y) {
                let got: Vec<f32> = sp.s.read(stream, "y").map_err(|e| e.to_string())?;
                let bad = got
                    .iter()
                    .filter(|&&v| v.to_bits() != value.to_bits())
                    .count();
                ensure!(
                    bad == 0,
                    "space {} y: {bad} values are not {value}",
                    sp.s.id()
                );
            }
        }
        Ok(())
    }

    fn copy_out(&mut self, si: usize, di: usize) -> Step<String> {
        let (sp, ds) = (&self.spaces[si], &self.datasets[di]);
        let want = if ds.offloaded.is_some() {
            Want::Offloaded(ds.d.id())
        } else if ds.group == X && sp.copy_in && sp.bound[X] != Some(ds.d.id()) {
            Want::Unbound("x".into())
        } else {
            Want::Ok
        };
        let text = format!("copy_out dataset {} from space {}", ds.d.id(), sp.s.id());
        if expect(sp.s.copy_out(&ds.d, &self.fx.gpu.stream), &want)?.is_some()
            && ds.group == X
            && sp.copy_in
        {
            let y = self.spaces[si].res_y;
            self.datasets[di].y = y;
        }
        Ok(text)
    }

    fn capture(&mut self, si: usize) -> Step<String> {
        let sp = &self.spaces[si];
        let a = if self.rng.gen_bool(0.5) { 1.0f32 } else { -1.0 };
        let b = self.rng.gen_range(-3i32..=3) as f32;
        let slot = |name: &str| sp.s.slot(name).unwrap().clone();
        let (x, y, t) = (slot("x"), slot("y"), slot("t"));
        let kernels = self.fx.gpu.kernels.clone();
        // The driver checks a copy node's addresses when it is captured: x must be mapped (a
        // bound dataset, or a copy-in group's own memory) and so must the scratch t (not asleep).
        let unmapped = sp.sleeping.is_some() || (sp.bound[X].is_none() && !sp.copy_in);
        let captured = sp.s.capture(&self.fx.gpu.stream, move |s| {
            buffer::copy_between(s, &t, 0, &x, 0, X_BYTES)?;
            kernels.affine(s, &y, a, b)
        });
        let g = match (captured, unmapped) {
            (Ok(g), false) => g,
            (
                Err(Error::Driver(DriverError::Failed {
                    call: "cuMemcpyDtoDAsync",
                    ..
                })),
                true,
            ) => {
                return Ok("capture over unmapped memory refused, as predicted".to_string());
            }
            (Ok(_), true) => {
                return Err("a capture of a copy over unmapped memory succeeded".into())
            }
            (Err(e), _) => return Err(format!("capture: {e}")),
        };
        let space = sp.s.id();
        self.graphs.push(Gr { g, space, a, b });
        Ok(format!("capture y = {a}·y + {b} over space {space}"))
    }

    fn replay(&mut self, gi: usize) -> Step<String> {
        let gr = &self.graphs[gi];
        let si = self.space_index(gr.space);
        let sp = &self.spaces[si];
        let want = if sp.sleeping.is_some() {
            Want::Asleep
        } else if let Some(g) = (0..2).find(|&g| sp.bound[g].is_none()) {
            Want::Unbound(GROUPS[g].into())
        } else {
            Want::Ok
        };
        let text = format!("replay graph over space {}", sp.s.id());
        let stream = self.g().stream.clone();
        let t = sp.s.slot("t").unwrap().clone();
        if sp.sleeping.is_none() {
            // Poison the scratch output, so a replay that did nothing cannot pass.
            self.g()
                .kernels
                .fill(&stream, &t, f32::NAN)
                .map_err(|e| e.to_string())?;
        }
        if expect(gr.g.replay(), &want)?.is_none() {
            return Ok(text);
        }
        stream.synchronize().map_err(|e| e.to_string())?;
        let (a, b) = (gr.a, gr.b);
        let (x, y, di) = self.slot_contents(si, X);
        if let Some(seed) = x {
            let bad = self.errors(&t, X_BYTES / 4, seed);
            ensure!(bad == 0, "{text}: {bad} elements of t are not x's pattern");
        }
        let y = y.map(|v| a * v + b);
        if self.spaces[si].copy_in {
            self.spaces[si].res_y = y;
        } else if let Some(di) = di {
            self.datasets[di].y = y;
        }
        if let Some(value) = y {
            let got: Vec<f32> = self.spaces[si]
                .s
                .read(&stream, "y")
                .map_err(|e| e.to_string())?;
            let bad = got
                .iter()
                .filter(|&&v| v.to_bits() != value.to_bits())
                .count();
            ensure!(bad == 0, "{text}: {bad} values of y are not {value}");
        }
        Ok(text)
    }

    fn offload(&mut self, di: usize, storage: HostStorage) -> Step<String> {
        let ds = &self.datasets[di];
        let id = ds.d.id();
        let text = format!("offload dataset {id} to {storage:?}");
        let resident = ds.offloaded.is_none();
        let bytes = ds.d.bytes();
        let fits = self.fx.arena.largest_free() >= footprint(bytes);
        let expected = match (&storage, resident) {
            (_, false) => StorageUsed::Discarded,
            (HostStorage::Pinned(_), true) if fits => StorageUsed::Arena,
            (HostStorage::Pinned(_), true) => StorageUsed::ArenaStaged,
            (HostStorage::Pageable, true) => StorageUsed::Pageable,
            (HostStorage::Discard, true) => StorageUsed::Discarded,
        };
        let stream = self.fx.gpu.stream.clone();
        let report = self.datasets[di]
            .d
            .offload(&storage, &stream)
            .map_err(|e| format!("{text}: {e}"))?;
        ensure!(
            report.storage == expected,
            "{text}: went to {:?}, expected {expected:?}",
            report.storage
        );
        ensure!(
            report.bytes == if resident { bytes } else { 0 },
            "{text}: {} bytes",
            report.bytes
        );
        if resident {
            self.unbind_everywhere(id);
            let ds = &mut self.datasets[di];
            ds.offloaded = Some((expected == StorageUsed::Arena).then(|| footprint(bytes)));
            if expected == StorageUsed::Discarded {
                (ds.w, ds.x, ds.y) = (None, None, None);
            }
        }
        Ok(text)
    }

    fn unbind_everywhere(&mut self, id: u64) {
        for sp in &mut self.spaces {
            for g in 0..2 {
                if sp.bound[g] == Some(id) {
                    sp.bound[g] = None;
                }
            }
        }
    }

    fn restore(&mut self, di: usize) -> Step<String> {
        let stream = self.fx.gpu.stream.clone();
        let ds = &mut self.datasets[di];
        let text = format!("restore dataset {}", ds.d.id());
        ds.d.restore(&stream).map_err(|e| format!("{text}: {e}"))?;
        ds.offloaded = None;
        Ok(text)
    }

    fn drop_dataset(&mut self, di: usize) -> String {
        let ds = self.datasets.remove(di);
        let id = ds.d.id();
        drop(ds);
        self.unbind_everywhere(id);
        format!("drop dataset {id}")
    }

    fn sleep(&mut self, si: usize) -> Step<String> {
        let storage = self.storage(true);
        let chosen: Vec<bool> = self
            .datasets
            .iter()
            .map(|_| self.rng.gen_bool(0.7))
            .collect();
        let sp = &self.spaces[si];
        let text = format!("sleep space {} to {storage:?}", sp.s.id());
        if sp.sleeping.is_some() {
            let reports =
                sp.s.sleep(
                    self.datasets.iter_mut().map(|d| &mut d.d),
                    &storage,
                    &self.fx.gpu.stream,
                )
                .map_err(|e| e.to_string())?;
            ensure!(reports.is_empty(), "sleeping an asleep space did something");
            return Ok(text + " (asleep already)");
        }
        let bound = sp.bound;
        // What the model expects to be offloaded, in world order.
        let mut expected = Vec::new();
        for (i, ds) in self.datasets.iter().enumerate() {
            if chosen[i] && bound.contains(&Some(ds.d.id())) {
                expected.push(i);
            }
        }
        let stream = self.fx.gpu.stream.clone();
        let space = self.spaces[si].s.clone();
        let reports = space
            .sleep(
                self.datasets
                    .iter_mut()
                    .zip(&chosen)
                    .filter(|(_, chosen)| **chosen)
                    .map(|(d, _)| &mut d.d),
                &storage,
                &stream,
            )
            .map_err(|e| format!("{text}: {e}"))?;
        ensure!(
            reports.len() == expected.len(),
            "{text}: {} offloads, the model expected {}",
            reports.len(),
            expected.len()
        );
        for (k, &i) in expected.iter().enumerate() {
            let used = reports[k].storage;
            // Whether each fits the arena depends on the ones before it; which of the two pinned
            // paths it took is checked through the arena's accounting (`check_everything`).
            let plausible = match &storage {
                HostStorage::Pinned(_) => {
                    matches!(used, StorageUsed::Arena | StorageUsed::ArenaStaged)
                }
                HostStorage::Pageable => used == StorageUsed::Pageable,
                HostStorage::Discard => used == StorageUsed::Discarded,
            };
            ensure!(
                plausible,
                "{text}: dataset {} went to {used:?}",
                self.datasets[i].d.id()
            );
            let id = self.datasets[i].d.id();
            let bytes = self.datasets[i].d.bytes();
            self.unbind_everywhere(id);
            let ds = &mut self.datasets[i];
            ds.offloaded = Some((used == StorageUsed::Arena).then(|| footprint(bytes)));
            if used == StorageUsed::Discarded {
                (ds.w, ds.x, ds.y) = (None, None, None);
            }
        }
        self.spaces[si].sleeping = Some(bound);
        self.check_bound(si)?;
        Ok(text)
    }

    fn wake(&mut self, si: usize) -> Step<String> {
        let stream = self.fx.gpu.stream.clone();
        let space = self.spaces[si].s.clone();
        let text = format!("wake space {}", space.id());
        let reports = space
            .wake(self.datasets.iter_mut().map(|d| &mut d.d), &stream)
            .map_err(|e| format!("{text}: {e}"))?;
        let Some(record) = self.spaces[si].sleeping.take() else {
            ensure!(reports.is_empty(), "{text}: woke an awake space");
            return Ok(text + " (awake already)");
        };
        let mut woken = 0;
        for di in 0..self.datasets.len() {
            if record.contains(&Some(self.datasets[di].d.id())) {
                self.datasets[di].offloaded = None;
                self.model_bind(si, di);
                woken += 1;
            }
        }
        ensure!(
            reports.len() == woken,
            "{text}: {} datasets woken, the model expected {woken}",
            reports.len()
        );
        self.check_bound(si)?;
        Ok(text)
    }

    // ------------------------------------------------------------------------------ pool

    fn register(&mut self) -> Step<String> {
        let key = self.next_tenant;
        self.next_tenant += 1;
        let limit = (self.tenants.iter().all(|t| t.limit.is_none()) && self.rng.gen_bool(0.5))
            .then_some(16 * MIB);
        let t = self
            .pool
            .register_limited(&format!("t{key}"), 256 * MIB, limit)
            .map_err(|e| e.to_string())?;
        self.tenants.push(Ten { t, key, limit });
        Ok(format!("register tenant t{key} (limit {limit:?})"))
    }

    fn unregister(&mut self, ti: usize) -> String {
        let ten = self.tenants.remove(ti);
        for blk in &mut self.blocks {
            if blk.tenant == ten.key {
                blk.gone = true;
                blk.len = 0;
            }
        }
        format!("unregister tenant t{}", ten.key)
    }

    fn held_by(&self, ti: usize) -> usize {
        self.tenants[ti].t.stats().map(|s| s.mapped).unwrap_or(0)
    }

    fn alloc_block(&mut self, ti: usize) -> Step<String> {
        let len = self.rng.gen_range(1..=4) * 2 * MIB - self.rng.gen_range(0..2) * 4096;
        let growable = self.rng.gen_bool(0.4);
        let capacity = if growable {
            len + self.rng.gen_range(0..=6) * MIB
        } else {
            len
        };
        let ten = &self.tenants[ti];
        let want = match ten.limit {
            Some(limit) if self.held_by(ti) + self.round(len) > limit => Want::OverBudget,
            _ => Want::Ok,
        };
        let text = format!("alloc {len} bytes (capacity {capacity}) for t{}", ten.key);
        let key = ten.key;
        let got = self.tenants[ti].t.alloc_growable(len, capacity);
        if let Some(b) = expect(got, &want)? {
            let seed = self.rng.gen();
            ensure!(
                b.len() == len && b.capacity() >= self.round(capacity.max(len)),
                "{text}: len {} capacity {}",
                b.len(),
                b.capacity()
            );
            self.fill(&b, len / 4, seed)?;
            let capacity = b.capacity();
            self.blocks.push(Blk {
                b,
                tenant: key,
                len,
                capacity,
                seed,
                known: len / 4,
                gone: false,
            });
        }
        Ok(text)
    }

    fn tenant_of(&self, bi: usize) -> Option<usize> {
        self.tenants
            .iter()
            .position(|t| t.key == self.blocks[bi].tenant)
    }

    fn grow(&mut self, bi: usize) -> Step<String> {
        let blk = &self.blocks[bi];
        let new_len = blk.len + self.rng.gen_range(0..=6) * MIB + self.rng.gen_range(0..2) * 100;
        let want = if blk.gone {
            Want::TenantGone
        } else if new_len > blk.capacity {
            Want::BeyondCapacity
        } else {
            let mapped = blk.b.info().map_err(|e| e.to_string())?.mapped;
            let needed = self.round(new_len);
            let ti = self.tenant_of(bi).unwrap();
            match self.tenants[ti].limit {
                Some(limit) if needed > mapped && self.held_by(ti) + needed - mapped > limit => {
                    Want::OverBudget
                }
                _ => Want::Ok,
            }
        };
        let text = format!("grow block {:#x} to {new_len}", blk.b.address());
        if expect(self.blocks[bi].b.grow(new_len), &want)?.is_some() {
            self.blocks[bi].len = new_len;
        }
        Ok(text)
    }

    fn shrink(&mut self, bi: usize) -> Step<String> {
        let blk = &self.blocks[bi];
        let new_len = if self.rng.gen_bool(0.1) {
            blk.len + 4096
        } else {
            self.rng.gen_range(0..=blk.len)
        };
        let want = if blk.gone {
            Want::TenantGone
        } else if new_len > blk.len {
            Want::InvalidShape
        } else {
            Want::Ok
        };
        let text = format!("shrink block {:#x} to {new_len}", blk.b.address());
        if expect(self.blocks[bi].b.shrink(new_len), &want)?.is_some() {
            let blk = &mut self.blocks[bi];
            blk.len = new_len;
            blk.known = blk.known.min(new_len / 4);
        }
        Ok(text)
    }

    fn graft(&mut self, ti: usize, di: usize) -> Step<String> {
        let (t, d) = (&self.blocks[ti], &self.blocks[di]);
        let want = if t.tenant != d.tenant {
            Want::InvalidShape
        } else if t.gone {
            Want::TenantGone
        } else {
            let (tinfo, dinfo) = (t.b.info().unwrap(), d.b.info().unwrap());
            if dinfo.len > tinfo.len || dinfo.mapped > tinfo.capacity {
                Want::InvalidShape
            } else {
                Want::Ok
            }
        };
        let text = format!("graft {:#x} onto {:#x}", d.b.address(), t.b.address());
        let (target, donor) = if ti < di {
            let (l, r) = self.blocks.split_at_mut(di);
            (&mut l[ti], &mut r[0])
        } else {
            let (l, r) = self.blocks.split_at_mut(ti);
            (&mut r[0], &mut l[di])
        };
        if expect(target.b.graft(&mut donor.b), &want)?.is_some() {
            target.seed = donor.seed;
            target.known = donor.known;
            self.blocks.remove(di);
        }
        Ok(text)
    }

    fn check_block(&self, bi: usize) -> Step<()> {
        let blk = &self.blocks[bi];
        if blk.gone {
            ensure!(
                blk.b.is_empty(),
                "a block of a gone tenant has length {}",
                blk.b.len()
            );
            ensure!(
                matches!(blk.b.info(), Err(Error::Pool(PoolError::TenantGone { .. }))),
                "gone block info"
            );
            return Ok(());
        }
        let info = blk.b.info().map_err(|e| e.to_string())?;
        ensure!(
            info.len == blk.len,
            "block {:#x}: len {} vs model {}",
            info.address,
            info.len,
            blk.len
        );
        ensure!(
            info.capacity == blk.capacity,
            "block capacity {} vs {}",
            info.capacity,
            blk.capacity
        );
        ensure!(
            self.round(blk.len) <= info.mapped && info.mapped <= info.capacity,
            "block {:#x}: mapped {} for len {} capacity {}",
            info.address,
            info.mapped,
            blk.len,
            info.capacity
        );
        if blk.known > 0 {
            let bad = self.errors(&blk.b, blk.known, blk.seed);
            ensure!(
                bad == 0,
                "block {:#x}: {bad} of {} known elements differ",
                info.address,
                blk.known
            );
        }
        Ok(())
    }

    fn check_pool(&self) -> Step<()> {
        let stats = self.pool.stats();
        let tenants = self.pool.tenant_stats();
        ensure!(
            stats.tenants == self.tenants.len(),
            "{} tenants, the model has {}",
            stats.tenants,
            self.tenants.len()
        );
        ensure!(
            stats.mapped == tenants.iter().map(|t| t.mapped).sum::<usize>(),
            "pool mapped vs tenants: {stats}"
        );
        ensure!(
            stats.mappings == tenants.iter().map(|t| t.mappings).sum::<usize>(),
            "pool mappings vs tenants"
        );
        for ten in &self.tenants {
            let ts = ten.t.stats().map_err(|e| e.to_string())?;
            let mine: Vec<&Blk> = self.blocks.iter().filter(|b| b.tenant == ten.key).collect();
            ensure!(
                ts.blocks == mine.len(),
                "t{}: {} blocks, the model has {}",
                ten.key,
                ts.blocks,
                mine.len()
            );
            let mapped: usize = mine
                .iter()
                .map(|b| b.b.info().map_or(0, |i| i.mapped))
                .sum();
            ensure!(
                mapped == ts.mapped,
                "t{}: blocks map {mapped}, the tenant holds {}",
                ten.key,
                ts.mapped
            );
            if let Some(limit) = ten.limit {
                ensure!(
                    ts.mapped <= limit,
                    "t{} holds {} over its limit",
                    ten.key,
                    ts.mapped
                );
            }
        }
        Ok(())
    }

    // --------------------------------------------------------------------------- regions

    fn new_region(&mut self) -> Step<String> {
        let tag = format!("r{}", self.next_region);
        self.next_region += 1;
        let r = Region::new(
            &self.fx.gpu.ctx,
            &tag,
            RegionOptions::default().capacity(REGION_CAPACITY),
        )
        .map_err(|e| e.to_string())?;
        self.regions.push(Reg {
            r,
            allocs: BTreeMap::new(),
            asleep: false,
            unbound: false,
            consolidated: 0,
            span: None,
            pieces: BTreeMap::new(),
            arena_footprint: 0,
            discarded: false,
            live: None,
        });
        Ok(format!("new region {tag}"))
    }

    fn span_end(reg: &Reg) -> usize {
        reg.allocs
            .iter()
            .next_back()
            .map_or(0, |(&o, a)| o + a.rounded)
    }

    /// Where the region's book places `rounded` bytes: the best fit inside the consolidated
    /// span (smallest run, then lowest), else the lowest room past it.
    fn placement(&self, reg: &Reg, rounded: usize) -> Option<(usize, bool)> {
        let g = self.fx.granularity;
        let capacity = reg.r.capacity() / g;
        let (count, limit) = (rounded / g, reg.consolidated / g);
        let mut runs = Vec::new();
        let mut at = 0;
        for (&offset, a) in &reg.allocs {
            if offset / g > at {
                runs.push((at, offset / g - at));
            }
            at = (offset + a.rounded) / g;
        }
        if capacity > at {
            runs.push((at, capacity - at));
        }
        let inside = runs
            .iter()
            .filter_map(|&(start, len)| {
                let end = (start + len).min(limit);
                (start < end && end - start >= count).then_some((end - start, start))
            })
            .min();
        if let Some((_, start)) = inside {
            return Some((start * g, true));
        }
        runs.iter()
            .find_map(|&(start, len)| {
                let first = start.max(limit);
                (start + len > first && start + len - first >= count).then_some(first)
            })
            .map(|start| (start * g, false))
    }

    fn region_want(reg: &Reg) -> Want {
        if reg.asleep {
            Want::RegionAsleep
        } else if reg.unbound {
            Want::Unbound(reg.r.tag().to_string())
        } else {
            Want::Ok
        }
    }

    fn region_alloc(&mut self, ri: usize) -> Step<String> {
        let asked = if self.rng.gen_bool(0.3) {
            self.rng.gen_range(1..=64 << 10)
        } else {
            self.rng.gen_range(1..=5 * MIB)
        };
        let rounded = self.round(asked);
        let reg = &self.regions[ri];
        let want = Self::region_want(reg);
        let text = format!("region {} alloc {asked}", reg.r.tag());
        let predicted = self
            .placement(reg, rounded)
            .ok_or("no room in the region")?;
        let Some(address) = expect(reg.r.alloc(asked), &want)? else {
            return Ok(text);
        };
        let offset = (address - reg.r.base()) as usize;
        ensure!(
            offset == predicted.0,
            "{text}: placed at {offset:#x}, the model expected {:#x}",
            predicted.0
        );
        let seed = self.rng.gen();
        let fill = self.rng.gen_bool(0.9);
        if fill {
            self.fill(&range(address, asked), asked / 4, seed)?;
        }
        let reg = &mut self.regions[ri];
        if !predicted.1 {
            reg.pieces.insert(offset, rounded);
        }
        reg.allocs.insert(
            offset,
            Alloc {
                asked,
                rounded,
                seed: fill.then_some(seed),
            },
        );
        Ok(text)
    }

    fn region_free(&mut self, ri: usize) -> Step<String> {
        let reg = &self.regions[ri];
        let picked = self.rng.gen_range(0..=reg.allocs.len());
        let offset = reg.allocs.keys().nth(picked).copied();
        let bogus = reg.r.capacity() - 4096;
        let address = reg.r.base() + offset.unwrap_or(bogus) as u64;
        let want = if offset.is_some() {
            Want::Ok
        } else {
            Want::UnknownAllocation
        };
        let text = format!("region {} free {:#x}", reg.r.tag(), offset.unwrap_or(bogus));
        if let Some(asked) = expect(reg.r.free(address), &want)? {
            let offset = offset.unwrap();
            let reg = &mut self.regions[ri];
            let a = reg.allocs.remove(&offset).unwrap();
            ensure!(
                asked == a.asked,
                "{text}: freed {asked} bytes, allocated {}",
                a.asked
            );
            reg.pieces.remove(&offset);
        }
        Ok(text)
    }

    fn region_write(&mut self, ri: usize) -> Step<String> {
        let reg = &self.regions[ri];
        let Some((&offset, &a)) = reg
            .allocs
            .iter()
            .nth(self.rng.gen_range(0..reg.allocs.len().max(1)))
        else {
            return Ok("region write: nothing allocated".into());
        };
        let address = reg.r.base() + offset as u64;
        let text = format!("region {} write {offset:#x}", reg.r.tag());
        let want = Self::region_want(reg);
        if want != Want::Ok {
            // Unmapped: only the checked copy may try, and it must refuse.
            expect(reg.r.write(&self.g().stream, address, &[0u32; 4]), &want)?;
            return Ok(text + " (refused)");
        }
        let seed = self.rng.gen();
        self.fill(&range(address, a.asked), a.asked / 4, seed)?;
        self.regions[ri].allocs.get_mut(&offset).unwrap().seed = Some(seed);
        Ok(text)
    }

    fn region_read(&mut self, ri: usize) -> Step<String> {
        let reg = &self.regions[ri];
        let known: Vec<(usize, Alloc)> = reg
            .allocs
            .iter()
            .filter(|(_, a)| a.seed.is_some() && a.asked >= 64)
            .map(|(&o, &a)| (o, a))
            .collect();
        let bogus = self.rng.gen_bool(0.15) || known.is_empty();
        let (offset, seed) = if bogus {
            (reg.r.capacity() - 4096, None)
        } else {
            let (o, a) = known[self.rng.gen_range(0..known.len())];
            (o, a.seed)
        };
        let want = match Self::region_want(reg) {
            Want::Ok if bogus => Want::UnknownAllocation,
            other => other,
        };
        let mut out = [0u32; 16];
        let text = format!("region {} read {offset:#x}", reg.r.tag());
        let got = reg
            .r
            .read_into(&self.g().stream, reg.r.base() + offset as u64, &mut out);
        if expect(got, &want)?.is_some() {
            let seed = seed.unwrap();
            for (i, &v) in out.iter().enumerate() {
                ensure!(
                    v == pattern(i as u64, seed),
                    "{text}: element {i} is {v:#x}"
                );
            }
        }
        Ok(text)
    }

    /// The contents of held snapshots under `ri`'s span are fixed from now on: the allocations
    /// the span backs (not those in chunks of their own past it).
    fn freeze_span(&mut self, ri: usize) {
        let reg = &self.regions[ri];
        let Some(Span {
            bytes,
            id: Some(id),
        }) = reg.span
        else {
            return;
        };
        let contents: BTreeMap<usize, Alloc> = reg
            .allocs
            .iter()
            .filter(|(&o, a)| !reg.pieces.contains_key(&o) && o + a.rounded <= bytes)
            .map(|(&o, &a)| (o, a))
            .collect();
        for snap in &mut self.snaps {
            if snap.s.id() == id {
                snap.frozen = Some(contents.clone());
            }
        }
    }

    fn region_sleep(&mut self, ri: usize) -> Step<String> {
        let storage = self.storage(true);
        let reg = &self.regions[ri];
        let text = format!("region {} sleep to {storage:?}", reg.r.tag());
        let want = if reg.asleep {
            Want::Ok
        } else if reg.unbound {
            Want::Unbound(reg.r.tag().to_string())
        } else {
            Want::Ok
        };
        let total: usize = reg.allocs.values().map(|a| a.rounded).sum();
        let fits = total > 0 && self.fx.arena.largest_free() >= footprint(total);
        let was_asleep = reg.asleep;
        if expect(reg.r.sleep(&storage, &self.g().stream), &want)?.is_none() || was_asleep {
            return Ok(text);
        }
        self.freeze_span(ri);
        let reg = &mut self.regions[ri];
        reg.asleep = true;
        reg.live = None;
        reg.span = None;
        reg.pieces.clear();
        reg.consolidated = 0;
        reg.arena_footprint = match storage {
            HostStorage::Pinned(_) if fits => footprint(total),
            _ => 0,
        };
        reg.discarded = matches!(storage, HostStorage::Discard);
        Ok(text)
    }

    fn region_wake(&mut self, ri: usize) -> Step<String> {
        let reg = &mut self.regions[ri];
        let text = format!("region {} wake", reg.r.tag());
        reg.r
            .wake(&self.fx.gpu.stream)
            .map_err(|e| format!("{text}: {e}"))?;
        if !reg.asleep {
            return Ok(text);
        }
        let end = Self::span_end(reg);
        if end > 0 {
            reg.span = Some(Span {
                bytes: end,
                id: None,
            });
            reg.consolidated = end;
        }
        reg.asleep = false;
        reg.arena_footprint = 0;
        if reg.discarded {
            for a in reg.allocs.values_mut() {
                a.seed = None;
            }
        }
        Ok(text)
    }

    fn region_snapshot(&mut self, ri: usize) -> Step<String> {
        let reg = &self.regions[ri];
        let end = Self::span_end(reg);
        let want = match Self::region_want(reg) {
            Want::Ok if end == 0 => Want::InvalidShape,
            other => other,
        };
        let text = format!("region {} snapshot", reg.r.tag());
        let Some(snapshot) = expect(reg.r.snapshot(&self.fx.gpu.stream), &want)? else {
            return Ok(text);
        };
        ensure!(
            snapshot.bytes() == end,
            "{text}: {} bytes for a span of {end}",
            snapshot.bytes()
        );
        let current = reg.span.map_or(0, |s| s.bytes);
        if !reg.pieces.is_empty() || current != end {
            self.freeze_span(ri);
            let reg = &mut self.regions[ri];
            reg.span = Some(Span {
                bytes: end,
                id: None,
            });
            reg.pieces.clear();
            reg.consolidated = end;
        }
        let reg = &mut self.regions[ri];
        if reg.live.is_some_and(|(_, bytes)| bytes < end) {
            reg.live = None;
        }
        let reg = &self.regions[ri];
        self.snaps.push(Snap {
            region: reg.r.id(),
            frozen: Some(reg.allocs.clone()),
            s: snapshot,
        });
        Ok(text)
    }

    fn region_keep_bound(&mut self, ri: usize) -> Step<String> {
        let reg = &mut self.regions[ri];
        let text = format!("region {} keep the bound snapshot", reg.r.tag());
        match (reg.r.bound(), reg.span) {
            (None, None) => {}
            (Some(s), Some(span)) => {
                ensure!(
                    s.bytes() == span.bytes,
                    "{text}: {} bytes, the span has {}",
                    s.bytes(),
                    span.bytes
                );
                ensure!(
                    span.id.is_none_or(|id| id == s.id()),
                    "{text}: another snapshot is bound"
                );
                reg.span = Some(Span {
                    bytes: span.bytes,
                    id: Some(s.id()),
                });
                let region = reg.r.id();
                self.snaps.push(Snap {
                    s,
                    region,
                    frozen: None,
                });
            }
            (got, span) => {
                return Err(format!(
                    "{text}: bound {:?}, the model's span {span:?}",
                    got.map(|s| s.bytes())
                ))
            }
        }
        Ok(text)
    }

    fn region_bind(&mut self, ri: usize, si: usize) -> Step<String> {
        let (reg, snap) = (&self.regions[ri], &self.snaps[si]);
        let end = Self::span_end(reg);
        let want = if snap.region != reg.r.id() {
            Want::SnapshotMismatch
        } else if reg.asleep {
            Want::RegionAsleep
        } else if reg.span.and_then(|s| s.id) == Some(snap.s.id()) {
            Want::Ok
        } else if !reg.pieces.is_empty() || snap.s.bytes() < end {
            Want::SnapshotMismatch
        } else {
            Want::Ok
        };
        let same = reg.span.and_then(|s| s.id) == Some(snap.s.id());
        let text = format!("region {} bind snapshot {}", reg.r.tag(), snap.s.id());
        if expect(reg.r.bind(&snap.s), &want)?.is_none() || same {
            return Ok(text);
        }
        let (id, bytes) = (snap.s.id(), snap.s.bytes());
        let frozen = snap
            .frozen
            .clone()
            .ok_or("binding a snapshot the model thinks is under a region")?;
        self.put_set_under(ri, id, bytes, &frozen);
        Ok(text)
    }

    /// The model's side of weight set `id` going under region `ri` with `contents` (a bind, a
    /// remap switch, or a copy switch's live set): a held set under the old span keeps what
    /// it holds now, the new one is under the region from now on, and each allocation holds
    /// what the set holds at its place.
    fn put_set_under(
        &mut self,
        ri: usize,
        id: u64,
        bytes: usize,
        contents: &BTreeMap<usize, Alloc>,
    ) {
        self.freeze_span(ri);
        for s in &mut self.snaps {
            if s.s.id() == id {
                s.frozen = None;
            }
        }
        let reg = &mut self.regions[ri];
        for (offset, a) in reg.allocs.iter_mut() {
            a.seed = Self::seed_from_set(contents, *offset, a);
        }
        reg.span = Some(Span {
            bytes,
            id: Some(id),
        });
        reg.consolidated = bytes;
        reg.unbound = false;
    }

    /// `switch_to` by copy or by remap: a copy puts the region's own live set under it with
    /// the chosen set's contents and never changes the chosen set; a switch to the set bound
    /// now does nothing (reported as a remap).
    fn region_switch(&mut self, ri: usize, si: usize) -> Step<String> {
        let strategy = if self.rng.gen_bool(0.5) {
            SwitchStrategy::Copy
        } else {
            SwitchStrategy::Remap
        };
        let (reg, snap) = (&self.regions[ri], &self.snaps[si]);
        let end = Self::span_end(reg);
        let same = reg.span.and_then(|s| s.id) == Some(snap.s.id());
        let want = if snap.region != reg.r.id() {
            Want::SnapshotMismatch
        } else if reg.asleep {
            Want::RegionAsleep
        } else if same {
            Want::Ok
        } else if !reg.pieces.is_empty() || snap.s.bytes() < end {
            Want::SnapshotMismatch
        } else {
            Want::Ok
        };
        let text = format!(
            "region {} switch to snapshot {} by {strategy:?}",
            reg.r.tag(),
            snap.s.id()
        );
        let Some(way) = expect(
            reg.r.switch_to(&snap.s, strategy, &self.fx.gpu.stream),
            &want,
        )?
        else {
            return Ok(text);
        };
        // An empty region has nothing to copy: every switch of it is a remap.
        let copied = matches!(strategy, SwitchStrategy::Copy) && !same && end > 0;
        ensure!(
            way == if copied {
                Switched::Copied
            } else {
                Switched::Remapped
            },
            "{text}: went by {way:?}"
        );
        if same {
            return Ok(text);
        }
        let contents = snap
            .frozen
            .clone()
            .ok_or("switching to a snapshot the model thinks is under a region")?;
        let (id, bytes) = if copied {
            let live = reg
                .r
                .bound()
                .ok_or_else(|| format!("{text}: nothing bound after a copy switch"))?;
            ensure!(
                live.id() != snap.s.id(),
                "{text}: a copy switch bound the caller's set"
            );
            if let Some((id, bytes)) = reg.live {
                ensure!(
                    live.id() == id || bytes < end,
                    "{text}: a new live set although the old one covers the span"
                );
            }
            (live.id(), live.bytes())
        } else {
            (snap.s.id(), snap.s.bytes())
        };
        if copied {
            self.regions[ri].live = Some((id, bytes));
        }
        self.put_set_under(ri, id, bytes, &contents);
        Ok(text)
    }

    /// What allocation `a` at `offset` holds once a weight set with contents `set` is under
    /// it: the set's pattern where the set has an allocation starting at the same place that
    /// was filled over at least `a`'s length. An equal offset and rounded size are not enough:
    /// a set taken when a shorter allocation sat there (the same granules) holds bytes past that
    /// one's end that nobody wrote, and the model once took them for the pattern (the "wrong
    /// data" failure at seed 1795667492865211295: 80383 elements, exactly the difference between
    /// the two allocations' lengths, were never wrong in the library).
    fn seed_from_set(set: &BTreeMap<usize, Alloc>, offset: usize, a: &Alloc) -> Option<u32> {
        set.get(&offset)
            .filter(|f| f.asked >= a.asked)
            .and_then(|f| f.seed)
    }

    fn region_unbind(&mut self, ri: usize) -> Step<String> {
        let reg = &self.regions[ri];
        let want = if reg.asleep {
            Want::RegionAsleep
        } else if !reg.pieces.is_empty() {
            Want::SnapshotMismatch
        } else {
            Want::Ok
        };
        let text = format!("region {} unbind", reg.r.tag());
        if expect(reg.r.unbind(), &want)?.is_none() || reg.unbound {
            return Ok(text);
        }
        self.freeze_span(ri);
        let reg = &mut self.regions[ri];
        reg.span = None;
        reg.unbound = true;
        reg.live = None;
        Ok(text)
    }

    fn check_region(&self, ri: usize, contents: bool) -> Step<()> {
        let reg = &self.regions[ri];
        let stats = reg.r.stats();
        let allocated: usize = reg.allocs.values().map(|a| a.rounded).sum();
        let mapped = reg.span.map_or(0, |s| s.bytes) + reg.pieces.values().sum::<usize>();
        let mappings = reg.pieces.len() + usize::from(reg.span.is_some());
        let want = (
            reg.allocs.len(),
            allocated,
            Self::span_end(reg),
            mapped,
            mappings,
            reg.asleep,
            // A discarded sleep holds no bytes on the host.
            if reg.asleep && !reg.discarded {
                allocated
            } else {
                0
            },
        );
        let got = (
            stats.allocations,
            stats.allocated,
            stats.span,
            stats.mapped,
            stats.mappings,
            stats.asleep,
            stats.host_bytes,
        );
        ensure!(
            got == want,
            "region {} stats (allocations, allocated, span, mapped, mappings, asleep, host bytes) {got:?}, the model has {want:?}",
            reg.r.tag()
        );
        let guard = reg.r.check_replayable();
        expect(guard, &Self::region_want(reg))?;
        if contents && !reg.asleep && !reg.unbound {
            for (&offset, a) in &reg.allocs {
                if let Some(seed) = a.seed {
                    let r = range(reg.r.base() + offset as u64, a.asked);
                    let bad = self.errors(&r, a.asked / 4, seed);
                    ensure!(
                        bad == 0,
                        "region {} allocation {offset:#x}: {bad} elements differ",
                        reg.r.tag()
                    );
                }
            }
        }
        Ok(())
    }

    fn check_snapshot(&self, si: usize) -> Step<()> {
        let snap = &self.snaps[si];
        let Some(frozen) = &snap.frozen else {
            return Ok(()); // under its region: checked as the region
        };
        let home = snap.s.home_ptr().map_err(|e| e.to_string())?;
        for (&offset, a) in frozen {
            if let (Some(seed), true) = (a.seed, offset + a.rounded <= snap.s.bytes()) {
                let bad = self.errors(&range(home + offset as u64, a.asked), a.asked / 4, seed);
                ensure!(
                    bad == 0,
                    "snapshot {} at {offset:#x}: {bad} elements differ",
                    snap.s.id()
                );
            }
        }
        Ok(())
    }

    fn drop_region(&mut self, ri: usize) -> String {
        self.freeze_span(ri);
        let reg = self.regions.remove(ri);
        format!("drop region {}", reg.r.tag())
    }

    // ----------------------------------------------------------------------- whole world

    /// Device memory the model says is held, beyond the baseline.
    fn model_bytes(&self) -> usize {
        let spaces: usize = self
            .spaces
            .iter()
            .map(|sp| {
                let scratch = if sp.sleeping.is_some() {
                    0
                } else {
                    self.fx.scratch_bytes
                };
                scratch
                    + if sp.copy_in {
                        self.fx.group_bytes[X]
                    } else {
                        0
                    }
            })
            .sum();
        let datasets: usize = self
            .datasets
            .iter()
            .filter(|d| d.offloaded.is_none())
            .map(|d| self.fx.group_bytes[d.group])
            .sum();
        let stats = self.pool.stats();
        let regions: usize = self
            .regions
            .iter()
            .map(|r| r.span.map_or(0, |s| s.bytes) + r.pieces.values().sum::<usize>())
            .sum();
        let spans: BTreeSet<u64> = self
            .regions
            .iter()
            .filter_map(|r| r.span.and_then(|s| s.id))
            .collect();
        let held: BTreeMap<u64, usize> = self
            .snaps
            .iter()
            .filter(|s| !spans.contains(&s.s.id()))
            .map(|s| (s.s.id(), s.s.bytes()))
            .collect();
        // A live set neither under its region nor held by the test still holds its memory.
        let live: usize = self
            .regions
            .iter()
            .filter_map(|r| r.live)
            .filter(|(id, _)| !spans.contains(id) && !held.contains_key(id))
            .map(|(_, bytes)| bytes)
            .sum();
        spaces
            + datasets
            + stats.mapped
            + stats.cached
            + regions
            + held.values().sum::<usize>()
            + live
    }

    fn arena_in_use(&self) -> usize {
        let datasets: usize = self
            .datasets
            .iter()
            .filter_map(|d| d.offloaded.flatten())
            .sum();
        datasets
            + self
                .regions
                .iter()
                .map(|r| r.arena_footprint)
                .sum::<usize>()
    }

    /// A region as the model sees it, on one line (for STABLEBUF_TRACE_REGIONS).
    fn describe_region(&self, reg: &Reg) -> String {
        let allocs: Vec<String> = reg
            .allocs
            .iter()
            .map(|(o, a)| {
                format!(
                    "{o:#x}+{:#x}({}){}{}",
                    a.rounded,
                    a.asked,
                    if a.seed.is_some() { "" } else { "?" },
                    if reg.pieces.contains_key(o) { "p" } else { "" }
                )
            })
            .collect();
        format!(
            "{}: asleep {} unbound {} consolidated {:#x} span {:?} allocs [{}]",
            reg.r.tag(),
            reg.asleep,
            reg.unbound,
            reg.consolidated,
            reg.span,
            allocs.join(" ")
        )
    }

    fn check_regions_and_snapshots(&self) -> Step<()> {
        for i in 0..self.regions.len() {
            self.check_region(i, true)?;
        }
        for i in 0..self.snaps.len() {
            self.check_snapshot(i)?;
        }
        Ok(())
    }

    /// Every known byte, every statistic.
    fn check_everything(&self) -> Step<()> {
        for i in 0..self.datasets.len() {
            self.check_dataset_at(i)?;
        }
        for i in 0..self.spaces.len() {
            self.check_bound(i)?;
            self.check_space(i)?;
        }
        for i in 0..self.blocks.len() {
            self.check_block(i)?;
        }
        self.check_pool()?;
        for i in 0..self.regions.len() {
            self.check_region(i, true)?;
        }
        for i in 0..self.snaps.len() {
            self.check_snapshot(i)?;
        }
        let in_use = self.fx.arena.capacity() - self.fx.arena.free_bytes();
        ensure!(
            in_use == self.arena_in_use(),
            "the arena holds {in_use} bytes, the model {}",
            self.arena_in_use()
        );
        Ok(())
    }

    /// One random operation.
    fn step(&mut self) -> Step<String> {
        let roll = self.rng.gen_range(0..100);
        match roll {
            0..=2 if self.spaces.len() < 3 => self.new_space(),
            0..=2 if !self.spaces.is_empty() && self.rng.gen_bool(0.3) => {
                let i = self.rng.gen_range(0..self.spaces.len());
                Ok(self.drop_space(i))
            }
            3..=5 if self.datasets.len() < 8 => self.new_dataset(),
            3..=5 if !self.datasets.is_empty() => {
                let i = self.rng.gen_range(0..self.datasets.len());
                Ok(self.drop_dataset(i))
            }
            6..=8 if !self.datasets.is_empty() => {
                let i = self.rng.gen_range(0..self.datasets.len());
                self.write_dataset_at(i)?;
                self.check_dataset_at(i)?;
                Ok(format!("write dataset {}", self.datasets[i].d.id()))
            }
            9..=18 if !self.spaces.is_empty() && !self.datasets.is_empty() => {
                let (si, di) = (
                    self.rng.gen_range(0..self.spaces.len()),
                    self.rng.gen_range(0..self.datasets.len()),
                );
                let on_stream = self.rng.gen_bool(0.25);
                self.bind(si, di, on_stream)
            }
            19..=20 if !self.spaces.is_empty() => {
                let si = self.rng.gen_range(0..self.spaces.len());
                let g = self.rng.gen_range(0..2);
                self.unbind(si, g)
            }
            21..=23 if !self.spaces.is_empty() => {
                let si = self.rng.gen_range(0..self.spaces.len());
                self.write_space(si)
            }
            24..=25 if !self.spaces.is_empty() => {
                let si = self.rng.gen_range(0..self.spaces.len());
                self.check_space(si)?;
                Ok(format!("check space {}", self.spaces[si].s.id()))
            }
            26 if !self.spaces.is_empty() && !self.datasets.is_empty() => {
                let (si, di) = (
                    self.rng.gen_range(0..self.spaces.len()),
                    self.rng.gen_range(0..self.datasets.len()),
                );
                self.copy_out(si, di)
            }
            27..=28 if !self.spaces.is_empty() && self.graphs.len() < 6 => {
                let si = self.rng.gen_range(0..self.spaces.len());
                self.capture(si)
            }
            29..=37 if !self.graphs.is_empty() => {
                let gi = self.rng.gen_range(0..self.graphs.len());
                self.replay(gi)
            }
            38 if !self.graphs.is_empty() => {
                let gi = self.rng.gen_range(0..self.graphs.len());
                // The check re-captures the graph's copy node, which the driver checks when it
                // is captured: refused while x or the scratch t is unmapped.
                let sp = &self.spaces[self.space_index(self.graphs[gi].space)];
                let unmapped = sp.sleeping.is_some() || (sp.bound[X].is_none() && !sp.copy_in);
                match (self.graphs[gi].g.check_update(), unmapped) {
                    (Ok(report), false) => {
                        ensure!(report.is_success(), "update check: {:?}", report.outcome);
                        Ok("update check".into())
                    }
                    (
                        Err(Error::Driver(DriverError::Failed {
                            call: "cuMemcpyDtoDAsync",
                            ..
                        })),
                        true,
                    ) => Ok("update check over unmapped memory refused, as predicted".into()),
                    (Ok(_), true) => Err("an update check over unmapped memory succeeded".into()),
                    (Err(e), _) => Err(format!("update check: {e}")),
                }
            }
            39 if !self.graphs.is_empty() => {
                let gi = self.rng.gen_range(0..self.graphs.len());
                self.graphs.remove(gi);
                Ok("drop graph".into())
            }
            40..=43 if !self.datasets.is_empty() => {
                let di = self.rng.gen_range(0..self.datasets.len());
                let storage = self.storage(true);
                self.offload(di, storage)
            }
            44..=47 if !self.datasets.is_empty() => {
                let di = self.rng.gen_range(0..self.datasets.len());
                self.restore(di)
            }
            48..=49 if !self.spaces.is_empty() => {
                let si = self.rng.gen_range(0..self.spaces.len());
                if self.rng.gen_bool(0.5) {
                    self.sleep(si)
                } else {
                    self.wake(si)
                }
            }
            50..=51 if self.tenants.len() < 3 => self.register(),
            50..=51 if self.rng.gen_bool(0.2) => {
                let ti = self.rng.gen_range(0..self.tenants.len());
                Ok(self.unregister(ti))
            }
            52..=56 if !self.tenants.is_empty() && self.blocks.len() < 14 => {
                let ti = self.rng.gen_range(0..self.tenants.len());
                self.alloc_block(ti)
            }
            57..=59 if !self.blocks.is_empty() => {
                let bi = self.rng.gen_range(0..self.blocks.len());
                self.grow(bi)
            }
            60..=61 if !self.blocks.is_empty() => {
                let bi = self.rng.gen_range(0..self.blocks.len());
                self.shrink(bi)
            }
            62..=64 if !self.blocks.is_empty() => {
                let bi = self.rng.gen_range(0..self.blocks.len());
                let blk = self.blocks.remove(bi);
                let text = format!("free block {:#x}", blk.b.address());
                blk.b.free().map_err(|e| format!("{text}: {e}"))?;
                Ok(text)
            }
            65 if self.blocks.len() >= 2 => {
                let ti = self.rng.gen_range(0..self.blocks.len());
                let di = (ti + self.rng.gen_range(1..self.blocks.len())) % self.blocks.len();
                let limited = self
                    .tenant_of(ti)
                    .is_some_and(|t| self.tenants[t].limit.is_some());
                if limited {
                    return Ok("graft skipped (limited tenant)".into());
                }
                self.graft(ti, di)
            }
            66 => {
                let cached = self.pool.stats().cached;
                let drained = self.pool.drain();
                ensure!(
                    drained == cached,
                    "drain released {drained} of {cached} cached bytes"
                );
                ensure!(self.pool.stats().cached == 0, "cache left after a drain");
                Ok("drain".into())
            }
            67 => {
                let on = self.rng.gen_bool(0.5);
                self.pool.set_stitching(on);
                Ok(format!("stitching {on}"))
            }
            68..=69 if !self.blocks.is_empty() => {
                let bi = self.rng.gen_range(0..self.blocks.len());
                self.check_block(bi)?;
                Ok("check block".into())
            }
            70 if self.regions.len() < 2 => self.new_region(),
            70 if self.rng.gen_bool(0.3) && !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                Ok(self.drop_region(ri))
            }
            71..=75
                if !self.regions.is_empty() && self.regions.iter().all(|r| r.allocs.len() < 10) =>
            {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_alloc(ri)
            }
            76..=78 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_free(ri)
            }
            79..=80 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_write(ri)
            }
            81..=82 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_read(ri)
            }
            83..=84 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_sleep(ri)
            }
            85..=86 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_wake(ri)
            }
            87..=88 if !self.regions.is_empty() && self.snaps.len() < 6 => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_snapshot(ri)
            }
            89 if !self.regions.is_empty() && self.snaps.len() < 6 => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_keep_bound(ri)
            }
            90..=92 if !self.regions.is_empty() && !self.snaps.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                let si = self.rng.gen_range(0..self.snaps.len());
                self.region_bind(ri, si)
            }
            93 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.region_unbind(ri)
            }
            94 if !self.snaps.is_empty() => {
                let si = self.rng.gen_range(0..self.snaps.len());
                self.check_snapshot(si)?;
                self.snaps.remove(si);
                Ok("check and drop a snapshot".into())
            }
            95..=96 if !self.regions.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                self.check_region(ri, true)?;
                Ok("check region".into())
            }
            97..=98 if !self.regions.is_empty() && !self.snaps.is_empty() => {
                let ri = self.rng.gen_range(0..self.regions.len());
                let si = self.rng.gen_range(0..self.snaps.len());
                self.region_switch(ri, si)
            }
            _ => Ok(String::new()),
        }
    }
}

/// Exercises every kind of object once and drops it, so the driver's lazily made internals
/// exist before the baseline is taken.
fn warm_up(fx: &Fixed) {
    let stream = &fx.gpu.stream;
    let options = SpaceOptions::default().group_bind("x", BindStrategy::CopyIn);
    let space = Space::with_options(&fx.gpu.ctx, layout(), options).unwrap();
    let mut d = space.new_dataset("x").unwrap();
    space.bind(&d).unwrap();
    let w_set = space.new_dataset("w").unwrap();
    space.bind(&w_set).unwrap();
    let t = space.slot("t").unwrap().clone();
    let x = space.slot("x").unwrap().clone();
    let graph = space
        .capture(stream, move |s| {
            buffer::copy_between(s, &t, 0, &x, 0, X_BYTES)
        })
        .unwrap();
    graph.replay().unwrap();
    stream.synchronize().unwrap();
    let _ = fx
        .gpu
        .kernels
        .pattern_mismatches(stream, space.slot("t").unwrap(), 0, 16, 1);
    for storage in [HostStorage::Pinned(fx.arena.clone()), HostStorage::Pageable] {
        d.offload(&storage, stream).unwrap();
        d.restore(stream).unwrap();
    }
    drop((graph, d, w_set, space));
    let pool = ElasticPool::new(&fx.gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("warm", 64 * MIB).unwrap();
    drop(tenant.alloc(4 * MIB).unwrap());
    pool.drain();
    drop((tenant, pool));
    let region = Region::new(
        &fx.gpu.ctx,
        "warm",
        RegionOptions::default().capacity(64 * MIB),
    )
    .unwrap();
    region.alloc(3 * MIB).unwrap();
    region
        .sleep(&HostStorage::Pinned(fx.arena.clone()), stream)
        .unwrap();
    region.wake(stream).unwrap();
    drop(region.snapshot(stream).unwrap());
    drop(region);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_sequences_of_every_operation_match_the_model() {
    let gpu = gpu();
    let rng = rng("random_sequences");
    let steps: usize = std::env::var("STABLEBUF_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let factory = Space::new(&gpu.ctx, layout()).unwrap();
    let placement = factory.placement().clone();
    let fx = Fixed {
        arena: HostArena::new(&gpu.ctx, ARENA_BYTES).unwrap(),
        group_bytes: [placement.groups[W].bytes, placement.groups[X].bytes],
        scratch_bytes: placement.scratch.as_ref().unwrap().bytes,
        granularity: placement.granularity,
        factory,
        gpu,
    };
    warm_up(&fx);
    let baseline = free_memory(&fx.gpu.ctx);
    let pool = ElasticPool::new(&fx.gpu.ctx, PoolOptions::default()).unwrap();
    let mut world = World {
        fx,
        rng,
        datasets: Vec::new(),
        spaces: Vec::new(),
        graphs: Vec::new(),
        pool,
        tenants: Vec::new(),
        blocks: Vec::new(),
        next_tenant: 0,
        regions: Vec::new(),
        snaps: Vec::new(),
        next_region: 0,
        counts: BTreeMap::new(),
    };
    let trace_regions = std::env::var_os("STABLEBUF_TRACE_REGIONS").is_some();
    let start = Instant::now();
    let mut history: VecDeque<String> = VecDeque::new();
    let mut worst_drift: i64 = 0;
    let fail = |step: usize, history: &VecDeque<String>, problem: String| -> ! {
        let recent: Vec<String> = history.iter().map(|h| format!("    {h}")).collect();
        panic!(
            "step {step}: {problem}\n  last operations (oldest first):\n{}\n  replay with \
             STABLEBUF_SEED (printed above) and STABLEBUF_STEPS={}",
            recent.join("\n"),
            step + 1
        );
    };
    for step in 0..steps {
        let outcome = world.step();
        let text = match outcome {
            Ok(text) => text,
            Err(problem) => fail(step, &history, problem),
        };
        if !text.is_empty() {
            let kind: String = text
                .split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ");
            *world.counts.entry(kind).or_default() += 1;
        }
        if trace_regions {
            // Diagnosis (STABLEBUF_TRACE_REGIONS=1): every region's layout and every known byte
            // after each step, so the first step whose bytes go wrong is the one printed. It
            // draws nothing from the generator: the sequence is the one the seed gives.
            if text.starts_with("region") || text.starts_with("drop region") {
                for reg in &world.regions {
                    eprintln!("  {step} {}", world.describe_region(reg));
                }
            }
            if let Err(problem) = world.check_regions_and_snapshots() {
                fail(
                    step,
                    &history,
                    format!("traced check after `{text}`: {problem}"),
                );
            }
        }
        history.push_back(format!("{step}: {text}"));
        if history.len() > 40 {
            history.pop_front();
        }
        let quiet = (step + 1) % 1000 == 0 || step + 1 == steps;
        if (step + 1) % 100 == 0 || quiet {
            if let Err(problem) = world.check_everything() {
                fail(step, &history, format!("full check: {problem}"));
            }
        }
        if quiet {
            let used = baseline as i64 - free_memory_counting_held(&world.fx.gpu.ctx) as i64;
            let drift = used - world.model_bytes() as i64;
            worst_drift = worst_drift.max(drift.abs());
            eprintln!(
                "step {:>6}: {:>3} objects, device memory in use {:>6.1} MiB, model {:>6.1} MiB, drift {:+.1} MiB",
                step + 1,
                world.datasets.len() + world.spaces.len() + world.graphs.len() + world.blocks.len() + world.regions.len() + world.snaps.len(),
                used as f64 / MIB as f64,
                world.model_bytes() as f64 / MIB as f64,
                drift as f64 / MIB as f64
            );
            if drift.unsigned_abs() as usize > MEMORY_SLACK {
                fail(
                    step,
                    &history,
                    format!("device memory differs from the model by {drift} bytes"),
                );
            }
        }
    }
    let elapsed = start.elapsed();
    let counts = std::mem::take(&mut world.counts);
    let arena = world.fx.arena.clone();
    let ctx = world.fx.gpu.ctx.clone();
    // Everything goes; what remains is the baseline's.
    let World {
        datasets,
        spaces,
        graphs,
        pool,
        tenants,
        blocks,
        regions,
        snaps,
        fx,
        ..
    } = world;
    drop((graphs, blocks, tenants, snaps, regions, datasets, spaces));
    pool.drain();
    drop(pool);
    let leaked = baseline as i64 - free_memory(&ctx) as i64;
    println!(
        "random sequences: {steps} steps in {:.1} s ({:.0} µs/step), {} errors as predicted, worst memory drift {:.1} MiB, {:.1} MiB held after dropping everything",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / steps.max(1) as f64,
        EXPECTED_ERRORS.load(Ordering::Relaxed),
        worst_drift as f64 / MIB as f64,
        leaked as f64 / MIB as f64
    );
    println!("  operations: {counts:?}");
    assert_eq!(
        arena.free_bytes(),
        arena.capacity(),
        "the pinned arena was not given back whole"
    );
    assert!(
        leaked <= MEMORY_SLACK as i64,
        "{leaked} bytes of device memory still held after dropping everything"
    );
    drop(fx);
}
