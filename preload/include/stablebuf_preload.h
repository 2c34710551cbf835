/*
 * stablebuf_preload.h: the C ABI of libstablebuf_preload.so, the LD_PRELOAD layer of
 * stablebuf (crate `stablebuf-preload`).
 *
 * The library is loaded with LD_PRELOAD; these functions are then found in the global
 * namespace. From C, link nothing and look them up at run time, so the same program also runs
 * without the layer:
 *
 *     int (*set_tag)(const char *) = dlsym(RTLD_DEFAULT, "stablebuf_set_tag");
 *     if (set_tag) set_tag("weights");
 *
 * From Python:  lib = ctypes.CDLL(None); lib.stablebuf_set_tag(b"weights")
 *
 * Every function returns one of the STABLEBUF_* codes below (0 is success) and never aborts
 * the program; a failure is also logged (set STABLEBUF_PRELOAD_LOG=warn to see the line).
 * All functions are thread-safe.
 */
#ifndef STABLEBUF_PRELOAD_H
#define STABLEBUF_PRELOAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- return codes ------------------------------------------------------------------------ */

/* success */
#define STABLEBUF_OK 0
/* invalid argument (NULL pointer, tag not UTF-8 or longer than 255 bytes, size 0) */
#define STABLEBUF_ERR_INVALID_ARGUMENT 1
/* out of device or pinned host memory; a resume that fails so keeps the host copy: retry
 * later */
#define STABLEBUF_ERR_OUT_OF_MEMORY 2
/* no thread ever set this tag with stablebuf_set_tag */
#define STABLEBUF_ERR_UNKNOWN_TAG 3
/* the layer is not in vmm mode (STABLEBUF_PRELOAD_MODE): nothing to pause */
#define STABLEBUF_ERR_NOT_VMM 4
/* a CUDA call failed; set STABLEBUF_PRELOAD_LOG=warn to see which */
#define STABLEBUF_ERR_CUDA 5
/* internal error in the layer (a bug; it was caught, the program goes on) */
#define STABLEBUF_ERR_INTERNAL 6
/* called in a child process after fork: the parent's pool is not usable here */
#define STABLEBUF_ERR_FORKED 7
/* the CUDA runtime or driver could not be found in this process */
#define STABLEBUF_ERR_NO_CUDA 8

/* A static, NUL-terminated description of a STABLEBUF_* code (never NULL). */
const char *stablebuf_error_string(int code);

/* ---- tags ---------------------------------------------------------------------------------- */

/*
 * Sets the calling thread's tag. Device memory this thread then allocates (cudaMalloc,
 * cudaMallocAsync, cuMemAlloc, in vmm mode) goes to the tag's region instead of the shared
 * pool, so it can be paused and resumed by tag. NULL or "" clears the tag (untagged memory).
 * The tag is per thread: other threads' allocations are not affected. Setting a tag makes it
 * known (pausing a tag never set is STABLEBUF_ERR_UNKNOWN_TAG). Works in every mode (outside
 * vmm it only records the tag).
 * Returns STABLEBUF_OK or STABLEBUF_ERR_INVALID_ARGUMENT.
 *
 * PyTorch note: the caching allocator calls cudaMalloc only for new segments, and may later
 * place other tensors in the free space of a tagged segment (they are then paused with it).
 * Allocate the tagged tensors in their own torch.cuda.MemPool to keep segments apart.
 */
int stablebuf_set_tag(const char *tag);

/* ---- pause and resume ----------------------------------------------------------------------- */

/*
 * Pauses a tag: waits for all work on the device, copies the contents of every allocation of
 * the tag to pinned host memory if keep_contents is non-zero (batched copies through one
 * arena pinned once), then releases the tag's physical memory. The addresses stay reserved:
 * pointers to paused memory stay valid numbers, and CUDA graphs captured over them replay
 * correctly after stablebuf_resume. NULL or "" pauses every tag.
 *
 * The first pause that keeps contents pins the host arena (about 0.5 s per GiB, once) unless
 * STABLEBUF_PRELOAD_HOST_ARENA or stablebuf_reserve_host() paid it before.
 *
 * WHILE PAUSED, NOTHING MAY TOUCH THE TAG'S MEMORY: the layer does not see kernels, so it
 * cannot stop one from reading or writing a paused range; doing so is an illegal-address
 * fault that ends the CUDA context. Allocating under a paused tag fails (cudaMalloc returns
 * cudaErrorNotPermitted); freeing paused memory is fine.
 *
 * Pausing a paused tag does nothing. Returns STABLEBUF_OK, STABLEBUF_ERR_UNKNOWN_TAG,
 * STABLEBUF_ERR_NOT_VMM, STABLEBUF_ERR_OUT_OF_MEMORY (pinned host memory), STABLEBUF_ERR_CUDA,
 * STABLEBUF_ERR_FORKED, STABLEBUF_ERR_NO_CUDA or STABLEBUF_ERR_INTERNAL. On an error the tag is
 * left awake.
 */
int stablebuf_pause(const char *tag, int keep_contents);

/*
 * Resumes a paused tag: maps new physical memory under the same addresses (one mapping for
 * the tag's whole span) and copies the kept contents back (without keep_contents the contents
 * are undefined). NULL or "" resumes every paused tag. Resuming an awake tag does nothing
 * (idempotent). STABLEBUF_ERR_OUT_OF_MEMORY leaves the tag paused with its host copy: free
 * memory and call again. Other codes as for stablebuf_pause.
 */
int stablebuf_resume(const char *tag);

/*
 * Pins `bytes` of host memory now for later pauses that keep contents (so the first pause does
 * not pay the pinning). Calling again with a larger size replaces the arena while no paused
 * tag holds data in it. Returns STABLEBUF_OK, STABLEBUF_ERR_INVALID_ARGUMENT (0 bytes),
 * STABLEBUF_ERR_NOT_VMM, STABLEBUF_ERR_OUT_OF_MEMORY, STABLEBUF_ERR_NO_CUDA or
 * STABLEBUF_ERR_CUDA.
 */
int stablebuf_reserve_host(size_t bytes);

/* ---- statistics ------------------------------------------------------------------------------ */

/*
 * Counters and sizes. Set `size` to sizeof(struct stablebuf_stats) before the call; the layer
 * writes at most that many bytes (whole fields) and sets `size` to what it wrote, so a program
 * built against an older, shorter struct keeps working and fields are only ever appended.
 * Byte counts are bytes; times are nanoseconds.
 */
struct stablebuf_stats {
    uint64_t size;              /* in: sizeof(struct stablebuf_stats); out: bytes written */
    uint64_t abi_version;       /* 2 (1: without the nccl_* fields) */
    uint64_t mode;              /* 0 off (or a child after fork), 1 monitor, 2 vmm */
    uint64_t live_allocations;  /* allocations the layer serves now (vmm) or saw live (monitor) */
    uint64_t live_bytes;        /* their bytes, as asked */
    uint64_t runtime_allocs;    /* cudaMalloc + cudaMallocAsync calls served (vmm) or seen (monitor) */
    uint64_t driver_allocs;     /* cuMemAlloc_v2 calls, by symbol or through an entry point */
    uint64_t frees;             /* frees of the layer's pointers */
    uint64_t foreign_frees;     /* frees passed on to CUDA (pointers the layer does not own) */
    uint64_t entry_points;      /* lookups (cuGetProcAddress, cudaGetDriverEntryPoint*) answered with a hook */
    uint64_t ipc_refusals;      /* cudaIpcGetMemHandle calls refused for the layer's pointers */
    uint64_t oom_errors;        /* requests answered out of memory */
    uint64_t pool_mapped;       /* physical bytes mapped by the pool (all devices) */
    uint64_t pool_cached;       /* physical bytes the pool keeps unmapped for reuse */
    uint64_t pool_peak_mapped;  /* highest pool_mapped so far */
    uint64_t pool_mappings;     /* live mappings */
    uint64_t pool_creates;      /* cuMemCreate calls */
    uint64_t pool_reuses;       /* requests served at least partly from the cache */
    uint64_t pool_stitched;     /* requests served by several chunks side by side */
    uint64_t pool_drains;       /* times the cache was released to make room */
    uint64_t copies_deferred;   /* copies copy elision deferred */
    uint64_t copies_elided;     /* deferred copies replaced by a remap (no copy) */
    uint64_t copies_performed;  /* deferred copies performed later (a flush point came first) */
    uint64_t copies_cancelled;  /* deferred copies dropped (the destination was freed first) */
    uint64_t bytes_elided;      /* bytes of the elided copies */
    uint64_t tags;              /* tags ever set */
    uint64_t tags_paused;       /* tags paused now */
    uint64_t tagged_bytes;      /* live bytes allocated under tags */
    uint64_t host_bytes;        /* bytes of paused tags held on the host */
    uint64_t host_arena_bytes;  /* pinned host memory held for pauses */
    uint64_t pauses;            /* successful stablebuf_pause calls */
    uint64_t resumes;           /* successful stablebuf_resume calls */
    uint64_t last_pause_ns;     /* duration of the last pause (device work included) */
    uint64_t last_resume_ns;    /* duration of the last resume */
    /* abi_version 2: NCCL registrations of tagged memory (ncclCommRegister through the layer) */
    uint64_t nccl_registrations;   /* registrations the layer keeps current across pauses */
    uint64_t nccl_suspended;       /* of those, not registered with NCCL now (tag paused, or re-registering failed) */
    uint64_t nccl_reregistrations; /* registrations made again after a resume */
    uint64_t nccl_failures;        /* deregistrations before a pause or registrations after a resume that failed */
};

/* Returns STABLEBUF_OK, or STABLEBUF_ERR_INVALID_ARGUMENT (NULL, or size < 8). */
int stablebuf_stats(struct stablebuf_stats *out);

/* ---- what the hooked CUDA functions return --------------------------------------------------
 *
 * The layer answers in the codes each API's callers expect:
 *   out of memory (pool, region, budget)   cudaErrorMemoryAllocation (2) / CUDA_ERROR_OUT_OF_MEMORY (2)
 *                                           (PyTorch then frees its cache and retries)
 *   bad argument, or a free of an address   cudaErrorInvalidValue (1) / CUDA_ERROR_INVALID_VALUE (1)
 *   inside (not at the start of) an allocation of the layer
 *   cudaIpcGetMemHandle of the layer's memory   cudaErrorInvalidValue (1), with one line on stderr
 *                                           naming STABLEBUF_PRELOAD_MODE=off
 *   allocating under a paused tag           cudaErrorNotPermitted (800) / CUDA_ERROR_NOT_PERMITTED (800)
 *   cudaFreeAsync of the layer's memory on a capturing stream
 *                                           cudaErrorStreamCaptureUnsupported (900)
 *   the real CUDA runtime/driver not found  cudaErrorSharedObjectSymbolNotFound (302) /
 *                                           CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND (302)
 *   no CUDA driver for the pool             cudaErrorInsufficientDriver (35) / CUDA_ERROR_NOT_INITIALIZED (3)
 *   no current context (cuMemAlloc)         what cuCtxGetDevice said (CUDA_ERROR_INVALID_CONTEXT, 201)
 *   another driver failure                  the driver's CUresult; for runtime callers the same number
 *                                           where both APIs agree (1, 2, 800, 801, 900-907), else
 *                                           cudaErrorUnknown (999)
 *   a panic inside the layer (a bug)        cudaErrorUnknown (999) / CUDA_ERROR_UNKNOWN (999)
 * Everything else is the real function's own result.
 *
 * The NCCL hooks (ncclCommRegister, ncclCommDeregister, ncclCommDestroy, ncclCommAbort; vmm mode,
 * README "NCCL registrations") answer in ncclResult_t:
 *   ncclCommRegister of tagged memory       ncclSuccess (0) and a proxy handle (an odd number);
 *                                           NCCL's own result if it refused the registration
 *   ncclCommRegister with a NULL handle     ncclInvalidArgument (4)
 *   ncclCommDeregister of a proxy           ncclSuccess (0), or NCCL's result for the real handle;
 *                                           ncclInvalidArgument (4) for a proxy no longer known,
 *                                           ncclInvalidUsage (5) with another communicator
 *   no libnccl found in the process         ncclSystemError (2)
 *   a panic inside the layer (a bug)        ncclInternalError (3)
 */

#ifdef __cplusplus
}
#endif

#endif /* STABLEBUF_PRELOAD_H */
