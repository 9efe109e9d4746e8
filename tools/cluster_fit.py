"""How many CTAs of the megakernel's shape can run at once in thread-block clusters of 1, 2, 4, 8 and 16 on this GPU:
cuOccupancyMaxActiveClusters for a kernel of --threads threads (the megakernel's 15 consumer warps and its producer
warp: 512) holding the most dynamic shared memory a block may have (as the megakernel does, one CTA an SM). The
persistent kernel spins on other CTAs' results, so every CTA of its grid must be resident at once: a cluster design
(a stage's CTAs handing data over distributed shared memory) fits only with a grid of at most the CTAs printed for
its cluster size. A cluster lies within one GPC, so a GPC's SMs beyond a multiple of the size stay idle; 16 is
past the portable 8 and needs the non-portable attribute. No CuTe DSL needed: a PTX kernel that returns, loaded
through the driver (cuda-bindings).
Usage: python3 tools/cluster_fit.py [--threads=T] (GPU host)"""
from __future__ import annotations

import sys

sys.path.insert(0, "tools")
from toolargs import int_flag, positional  # noqa: E402

USAGE = "cluster_fit.py [--threads=T]"
positional(__doc__, USAGE, 0, flags=("--threads",))
THREADS = int_flag("--threads", 512, USAGE)
SIZES = (1, 2, 4, 8, 16)
PTX = b"""
.version 8.0
.target sm_90a
.address_size 64
.visible .entry idle() { ret; }
"""

import torch  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("cluster_fit.py: no CUDA device (run it on the GPU host)")
from cuda.bindings import driver as cu  # noqa: E402


def checked(result):
    """The value of a cuda-bindings call, which returns (error, value...); exits naming the error."""
    err, *value = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        sys.exit(f"cluster_fit.py: {cu.cuGetErrorName(err)[1].decode()}")
    return value[0] if len(value) == 1 else value


def main():
    checked(cu.cuInit(0))
    dev = checked(cu.cuDeviceGet(torch.cuda.current_device()))
    checked(cu.cuCtxSetCurrent(checked(cu.cuDevicePrimaryCtxRetain(dev))))    # the context torch's runtime uses
    attr = cu.CUdevice_attribute
    sms = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    smem = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
    module = checked(cu.cuModuleLoadData(PTX))
    fn = checked(cu.cuModuleGetFunction(module, b"idle"))
    fattr = cu.CUfunction_attribute
    checked(cu.cuFuncSetAttribute(fn, fattr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    checked(cu.cuFuncSetAttribute(fn, fattr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; a CTA of {THREADS} threads and {smem} bytes of shared memory")
    print(f"{'cluster':>7} {'clusters at once':>17} {'CTAs at once':>13} {'SMs idle':>9}")
    for size in SIZES:
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (sms // size) * size, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = THREADS, 1, 1
        cfg.sharedMemBytes = smem
        la = cu.CUlaunchAttribute()
        la.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        la.value.clusterDim.x, la.value.clusterDim.y, la.value.clusterDim.z = size, 1, 1
        cfg.attrs, cfg.numAttrs = [la], 1
        err, clusters = cu.cuOccupancyMaxActiveClusters(fn, cfg)
        if err != cu.CUresult.CUDA_SUCCESS:
            print(f"{size:>7} {'(' + cu.cuGetErrorName(err)[1].decode() + ')':>17}")
            continue
        print(f"{size:>7} {clusters:>17} {clusters * size:>13} {sms - clusters * size:>9}")
    checked(cu.cuModuleUnload(module))


if __name__ == "__main__":
    main()
