#!/usr/bin/env python3
"""Writes the prototypes of the layer's flush-point hooks from CUDA's own headers.

    preload/tools/gen_hooks.py <cuda-include-dir>   # the dir with cuda.h and cuda_runtime_api.h

Prints the `runtime_flush_points!` and `driver_flush_points!` blocks of
`src/cuda/flush_points.rs` (name and prototype; the hooks, the real functions' tables and the
symbol table are all generated from that file) for every name in RUNTIME / DRIVER below. Per-thread variants (`_ptsz`, `_ptds`) have the prototype of the name
they stand for, which is the name looked up in the header. Used once to write the tables; kept
so a later CUDA's new entry points can be added the same way (the output is checked in).
"""
import re
import sys

# (exported name, name whose prototype it has)
def pt(names, suffix):
    out = []
    for n in names:
        out.append((n, n))
        out.append((n + suffix, n))
    return out

RUNTIME = (
    [("__cudaLaunchKernel", "__cudaLaunchKernel"), ("__cudaLaunchKernel_ptsz", "__cudaLaunchKernel")]
    + [(n + "_ptsz", n) for n in ["cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
                                  "cudaLaunchHostFunc", "cudaGraphLaunch", "cudaMemsetAsync", "cudaMemset2DAsync",
                                  "cudaMemcpy2DAsync", "cudaMemcpy3DAsync", "cudaStreamSynchronize", "cudaStreamQuery",
                                  "cudaStreamWaitEvent", "cudaStreamBeginCapture", "cudaEventRecord"]]
    + [(n + "_ptds", n) for n in ["cudaMemset", "cudaMemset2D", "cudaMemcpy2D", "cudaMemcpy3D",
                                  "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol"]]
    + pt(["cudaMemset3DAsync", "cudaMemcpy3DPeerAsync", "cudaMemcpy2DToArrayAsync", "cudaMemcpy2DFromArrayAsync",
          "cudaMemcpyToArrayAsync", "cudaMemcpyFromArrayAsync", "cudaMemcpyToSymbolAsync",
          "cudaMemcpyFromSymbolAsync", "cudaMemcpyBatchAsync", "cudaMemcpy3DBatchAsync", "cudaEventRecordWithFlags",
          "cudaStreamAddCallback", "cudaStreamBeginCaptureToGraph", "cudaSignalExternalSemaphoresAsync",
          "cudaWaitExternalSemaphoresAsync"], "_ptsz")
    + pt(["cudaMemset3D", "cudaMemcpy3DPeer", "cudaMemcpy2DToArray", "cudaMemcpy2DFromArray",
          "cudaMemcpy2DArrayToArray", "cudaMemcpyToArray", "cudaMemcpyFromArray", "cudaMemcpyArrayToArray"], "_ptds")
)

DRIVER = (
    [(n + "_ptsz", n) for n in ["cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch",
                                "cuMemcpyAsync", "cuMemcpyDtoDAsync_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                                "cuMemsetD8Async", "cuMemsetD32Async", "cuStreamSynchronize"]]
    + [(n + "_ptds", n) for n in ["cuMemcpy", "cuMemcpyDtoD_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
                                  "cuMemsetD8_v2", "cuMemsetD32_v2"]]
    + pt(["cuLaunchHostFunc", "cuMemcpyPeerAsync", "cuMemcpyHtoAAsync_v2", "cuMemcpyAtoHAsync_v2",
          "cuMemcpy2DAsync_v2", "cuMemcpy3DAsync_v2", "cuMemcpy3DPeerAsync", "cuMemcpyBatchAsync_v2",
          "cuMemcpy3DBatchAsync_v2", "cuMemsetD16Async", "cuMemsetD2D8Async", "cuMemsetD2D16Async",
          "cuMemsetD2D32Async", "cuStreamWriteValue32_v2", "cuStreamWriteValue64_v2", "cuStreamWaitValue32_v2",
          "cuStreamWaitValue64_v2", "cuStreamBatchMemOp_v2", "cuStreamQuery", "cuStreamWaitEvent", "cuEventRecord",
          "cuEventRecordWithFlags", "cuStreamAddCallback", "cuStreamBeginCapture_v2", "cuStreamBeginCaptureToGraph",
          "cuSignalExternalSemaphoresAsync", "cuWaitExternalSemaphoresAsync", "cuMemBatchDecompressAsync"], "_ptsz")
    + pt(["cuMemcpyPeer", "cuMemcpyDtoA_v2", "cuMemcpyAtoD_v2", "cuMemcpyHtoA_v2", "cuMemcpyAtoH_v2",
          "cuMemcpyAtoA_v2", "cuMemcpy2D_v2", "cuMemcpy2DUnaligned_v2", "cuMemcpy3D_v2", "cuMemcpy3DPeer",
          "cuMemsetD16_v2", "cuMemsetD2D8_v2", "cuMemsetD2D16_v2", "cuMemsetD2D32_v2"], "_ptds")
    + [(n, n) for n in ["cuEventSynchronize", "cuEventQuery", "cuCtxSynchronize_v2",
                        "cuLaunchCooperativeKernelMultiDevice"]]
)

TYPES = {
    "size_t": "usize", "int": "c_int", "unsigned int": "c_uint", "unsigned char": "u8",
    "unsigned short": "u16", "unsigned long long": "u64", "cuuint32_t": "u32", "cuuint64_t": "u64",
    "CUdeviceptr": "DevicePtr", "dim3": "Dim3", "struct cudaPitchedPtr": "PitchedPtr",
    "struct cudaExtent": "Extent",
}
ENUM_PREFIXES = ("enum ", "CUstreamCaptureMode", "CUmemDecompress")


def rust_type(ctype):
    ctype = re.sub(r"\b(const|__restrict__)\b", "", ctype).strip()
    ctype = re.sub(r"\s+", " ", ctype).replace(" *", "*")
    if "*" in ctype:
        return "*mut c_void"
    if ctype in TYPES:
        return TYPES[ctype]
    if ctype.startswith(ENUM_PREFIXES):
        return "c_int"
    # Handles: CUstream, cudaStream_t, CUgraphExec, cudaArray_t, cudaKernel_t, function pointers...
    if re.fullmatch(r"(CU[a-zA-Z]+|cuda[A-Za-z]+_t|cudaArray_const_t)", ctype):
        if ctype in ("CUstreamCaptureMode",):
            return "c_int"
        return "*mut c_void"
    raise SystemExit(f"unknown C type {ctype!r}")


def prototype(text, name):
    m = re.search(r"(?:CUresult|cudaError_t)\s+(?:CUDAAPI|CUDARTAPI)\s+" + re.escape(name) + r"\s*\(", text)
    if not m:
        raise SystemExit(f"no prototype for {name}")
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    params = re.sub(r"__dv\([^)]*\)", "", text[m.end():i - 1])
    params = re.sub(r"/\*.*?\*/", "", params, flags=re.S)
    out = []
    for p in [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]:
        pm = re.fullmatch(r"(.*?)(\w+)\s*(\[\s*\])?", p, flags=re.S)
        ctype, pname = pm.group(1), pm.group(2)
        if pm.group(3):
            ctype += "*"
        pname = {"fn": "func", "type": "kind", "ref": "reference"}.get(pname, pname)
        out.append((re.sub(r"(?<!^)(?=[A-Z])", "_", pname).lower(), rust_type(ctype)))
    return out


def main():
    inc = sys.argv[1]
    text = open(f"{inc}/cuda.h").read() + open(f"{inc}/cuda_runtime_api.h").read()
    extra = """cudaError_t CUDARTAPI __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim,
        void **args, size_t sharedMem, cudaStream_t stream);"""
    text += extra
    for lib, names in (("runtime", RUNTIME), ("driver", DRIVER)):
        print(f"{lib}_flush_points! {{")
        for exported, base in names:
            params = prototype(text, base)
            args = ", ".join(f"{n}: {t}" for n, t in params)
            print(f"    {exported}({args});")
        print("}")


main()
