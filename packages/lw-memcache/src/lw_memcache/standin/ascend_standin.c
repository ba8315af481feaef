/*
 * A host-memory stand-in for the Ascend runtime, so memcache_hybrid's PyPI build (an Ascend NPU
 * build) runs on a CPU-only machine. Built by lw_memcache.standin at first use and installed under
 * every library name memfabric dlopens (libascendcl.so, libascend_hal.so, libruntime.so, ...).
 *
 * Why it is enough: with the host protocols (host_shm, host_tcp) the pool lives in host memory;
 * memfabric still asks the runtime for a device id, a SoC name, streams, and routes every
 * same-node copy through aclrtMemcpy*. Here "device memory" is host memory, streams are
 * synchronous, and copies are memmove. Everything else returns success (0).
 * Set LW_STANDIN_TRACE=1 to log each call to stderr (to see what a new memfabric version needs).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

static int trace_on = -1;
static void trace(const char *name) {
    if (trace_on < 0) {
        const char *v = getenv("LW_STANDIN_TRACE");
        trace_on = v && *v && *v != '0';
    }
    if (trace_on) fprintf(stderr, "[ascend-standin] %s\n", name);
}

/* Opaque handles (streams, contexts, notifies) only need to be distinct non-null pointers. */
static uintptr_t next_handle = 0x1000;
static void *new_handle(void) { return (void *)__atomic_add_fetch(&next_handle, 16, __ATOMIC_RELAXED); }
static int32_t next_id = 0;

#define PAGE_ALIGN 4096

/* ---------- devices ---------- */
int aclrtSetDevice(int32_t id) { trace("aclrtSetDevice"); (void)id; return 0; }
int aclrtGetDevice(int32_t *id) { trace("aclrtGetDevice"); if (id) *id = 0; return 0; }
int aclrtGetPhyDevIdByLogicDevId(int32_t logic, int32_t *phy) {
    trace("aclrtGetPhyDevIdByLogicDevId"); if (phy) *phy = logic; return 0;
}
int rtGetLogicDevIdByUserDevId(int32_t user, int32_t *logic) {
    trace("rtGetLogicDevIdByUserDevId"); if (logic) *logic = user; return 0;
}
const char *aclrtGetSocName(void) { trace("aclrtGetSocName"); return "Ascend910B3"; }
int aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    trace("aclrtGetVersion");
    if (major) *major = 1; if (minor) *minor = 0; if (patch) *patch = 0;
    return 0;
}
int aclsysGetVersionStr(const char *pkg, char *out) {
    trace("aclsysGetVersionStr"); (void)pkg;
    if (out) strcpy(out, "8.2.RC1");
    return 0;
}
int rtGetDeviceInfo(uint32_t dev, int32_t module, int32_t info, int64_t *val) {
    trace("rtGetDeviceInfo"); (void)dev; (void)module; (void)info; if (val) *val = 0; return 0;
}
int rtDeviceGetBareTgid(uint32_t *pid) { trace("rtDeviceGetBareTgid"); if (pid) *pid = (uint32_t)getpid(); return 0; }
int aclrtGetCurrentContext(void **ctx) { trace("aclrtGetCurrentContext"); if (ctx) *ctx = new_handle(); return 0; }

/* ---------- streams and notifies: synchronous, so waits are no-ops ---------- */
int aclrtCreateStream(void **s) { trace("aclrtCreateStream"); if (s) *s = new_handle(); return 0; }
int aclrtCreateStreamWithConfig(void **s, uint32_t prio, uint32_t flag) {
    trace("aclrtCreateStreamWithConfig"); (void)prio; (void)flag; if (s) *s = new_handle(); return 0;
}
int aclrtStreamGetId(void *s, int32_t *id) {
    trace("aclrtStreamGetId"); (void)s; if (id) *id = __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED); return 0;
}
int rtStreamGetSqid(void *s, uint32_t *id) { trace("rtStreamGetSqid"); (void)s; if (id) *id = 1; return 0; }
int rtStreamGetCqid(void *s, uint32_t *cq, uint32_t *logic_cq) {
    trace("rtStreamGetCqid"); (void)s; if (cq) *cq = 1; if (logic_cq) *logic_cq = 1; return 0;
}
int aclrtCreateNotify(void **n, uint64_t flag) { trace("aclrtCreateNotify"); (void)flag; if (n) *n = new_handle(); return 0; }
int aclrtGetNotifyId(void *n, uint32_t *id) {
    trace("aclrtGetNotifyId"); (void)n; if (id) *id = (uint32_t)__atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED); return 0;
}

/* ---------- memory: "device" memory is page-aligned host memory ---------- */
static void *alloc_aligned(size_t size) {
    void *p = NULL;
    if (posix_memalign(&p, PAGE_ALIGN, size ? size : 1) != 0) return NULL;
    return p;
}
int aclrtMalloc(void **p, size_t size, int policy) {
    trace("aclrtMalloc"); (void)policy; if (!p) return 1; *p = alloc_aligned(size); return *p ? 0 : 1;
}
int aclrtMallocHost(void **p, size_t size) {
    trace("aclrtMallocHost"); if (!p) return 1; *p = alloc_aligned(size); return *p ? 0 : 1;
}
int aclrtFree(void *p) { trace("aclrtFree"); free(p); return 0; }
int aclrtFreeHost(void *p) { trace("aclrtFreeHost"); free(p); return 0; }

int halHostRegister(void *src, uint64_t size, uint32_t flag, uint32_t dev, void **dst) {
    trace("halHostRegister"); (void)size; (void)flag; (void)dev; if (dst) *dst = src; return 0;
}
int halMemGetAllocationGranularity(const void *prop, int option, size_t *g) {
    trace("halMemGetAllocationGranularity"); (void)prop; (void)option; if (g) *g = 2u << 20; return 0;
}

/* ---------- copies: every same-node copy of this build ends here ---------- */
int aclrtMemcpy(void *dst, size_t dmax, const void *src, size_t n, int kind) {
    trace("aclrtMemcpy"); (void)kind;
    if (n > dmax) return 1;
    memmove(dst, src, n);
    return 0;
}
int aclrtMemcpyAsync(void *dst, size_t dmax, const void *src, size_t n, int kind, void *stream) {
    trace("aclrtMemcpyAsync"); (void)kind; (void)stream;
    if (n > dmax) return 1;
    memmove(dst, src, n);
    return 0;
}
int rtMemcpyAsyncWithoutCheckKind(void *dst, uint64_t dmax, const void *src, uint64_t n, int kind, void *stream) {
    trace("rtMemcpyAsyncWithoutCheckKind"); (void)kind; (void)stream;
    if (n > dmax) return 1;
    memmove(dst, src, n);
    return 0;
}
static int copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height) {
    if (width > dpitch || width > spitch) return 1;
    for (size_t r = 0; r < height; r++)
        memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return 0;
}
int aclrtMemcpy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h, int kind) {
    trace("aclrtMemcpy2d"); (void)kind; return copy_2d(dst, dpitch, src, spitch, w, h);
}
int aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h, int kind,
                       void *stream) {
    trace("aclrtMemcpy2dAsync"); (void)kind; (void)stream; return copy_2d(dst, dpitch, src, spitch, w, h);
}
int aclrtMemcpyBatch(void **dsts, size_t *dmax, void **srcs, size_t *sizes, size_t n, void *attrs,
                     size_t *attr_idx, size_t n_attrs, size_t *fail_idx) {
    trace("aclrtMemcpyBatch"); (void)attrs; (void)attr_idx; (void)n_attrs;
    for (size_t i = 0; i < n; i++) {
        if (sizes[i] > dmax[i]) { if (fail_idx) *fail_idx = i; return 1; }
        memmove(dsts[i], srcs[i], sizes[i]);
    }
    return 0;
}
int aclrtMemset(void *p, size_t max, int32_t value, size_t n) {
    trace("aclrtMemset"); if (n > max) return 1; memset(p, value, n); return 0;
}

/* ---------- everything else: success, nothing to do on a host-only node ---------- */
#define OK_STUB(name) int name(void) { trace(#name); return 0; }
OK_STUB(aclrtDestroyStream) OK_STUB(aclrtSynchronizeStream) OK_STUB(aclrtDestroyNotify)
OK_STUB(aclrtWaitAndResetNotify) OK_STUB(aclrtSetStreamAttribute) OK_STUB(aclrtStreamAbort)
OK_STUB(aclrtDeviceEnablePeerAccess) OK_STUB(aclrtBinaryGetFunction) OK_STUB(aclrtBinaryLoadFromFile)
OK_STUB(aclrtKernelArgsAppend) OK_STUB(aclrtKernelArgsFinalize) OK_STUB(aclrtKernelArgsInit)
OK_STUB(aclrtLaunchKernelWithConfig) OK_STUB(aclCreateTensor) OK_STUB(aclDestroyTensor)
OK_STUB(aclnnShmemSdmaStarsQuery) OK_STUB(aclnnShmemSdmaStarsQueryGetWorkspaceSize)
OK_STUB(rtDisableP2P) OK_STUB(rtEnableP2P) OK_STUB(rtGetDevResAddress) OK_STUB(rtGetP2PStatus)
OK_STUB(rtIpcCloseMemory) OK_STUB(rtIpcDestroyMemoryName) OK_STUB(rtIpcOpenMemory) OK_STUB(rtIpcSetMemoryName)
OK_STUB(rtSetIpcMemorySuperPodPid)
OK_STUB(dcmiv2_get_affinity_cpu_info_by_dev_id) OK_STUB(dcmiv2_get_device_pcie_info)
OK_STUB(dcmiv2_get_eid_list_by_urma_dev_index) OK_STUB(dcmiv2_get_urma_device_cnt) OK_STUB(dcmiv2_init)
OK_STUB(drvMemGetAttribute) OK_STUB(drvNotifyIdAddrOffset)
OK_STUB(halCqReportRecv) OK_STUB(halHostUnregisterEx) OK_STUB(halMemAddressFree) OK_STUB(halMemAddressReserve)
OK_STUB(halMemAlloc) OK_STUB(halMemCreate) OK_STUB(halMemExportToShareableHandleV2) OK_STUB(halMemFree)
OK_STUB(halMemImportFromShareableHandleV2) OK_STUB(halMemMap) OK_STUB(halMemRelease)
OK_STUB(halMemRetainAllocationHandle) OK_STUB(halMemSetAccess) OK_STUB(halMemShareHandleSetAttribute)
OK_STUB(halMemTransShareableHandle) OK_STUB(halMemUnmap) OK_STUB(halResourceConfig) OK_STUB(halResourceDetailQuery)
OK_STUB(halResourceIdAlloc) OK_STUB(halResourceIdFree) OK_STUB(halSqCqAllocate) OK_STUB(halSqCqFree)
OK_STUB(halSqCqQuery) OK_STUB(halSqTaskSend) OK_STUB(svm_module_alloced_size_inc)
OK_STUB(TsdOpen) OK_STUB(HcclCommDestroy) OK_STUB(HcclCommInitClusterInfoMemConfig)
OK_STUB(RaAiQpCreate) OK_STUB(RaDeregisterMr) OK_STUB(RaGetIfaddrs) OK_STUB(RaGetIfnum) OK_STUB(RaGetNotifyBaseAddr)
OK_STUB(RaGetNotifyMrInfo) OK_STUB(RaGetQpStatus) OK_STUB(RaGetSockets) OK_STUB(RaInit) OK_STUB(RaQpConnectAsync)
OK_STUB(RaQpCreate) OK_STUB(RaQpCreateWithAttrs) OK_STUB(RaQpDestroy) OK_STUB(RaRdevGetHandle) OK_STUB(RaRdevInit)
OK_STUB(RaRdevInitV2) OK_STUB(RaRegisterMr) OK_STUB(RaSendWr) OK_STUB(RaSendWrV2) OK_STUB(RaSetQpAttrQos)
OK_STUB(RaSocketBatchClose) OK_STUB(RaSocketBatchConnect) OK_STUB(RaSocketBatchConnectLegacy) OK_STUB(RaSocketDeinit)
OK_STUB(RaSocketInit) OK_STUB(RaSocketListenStart) OK_STUB(RaSocketListenStop) OK_STUB(RaSocketWhiteListAdd)
OK_STUB(RaSocketWhiteListDel)
OK_STUB(HcommBatchModeEnd) OK_STUB(HcommBatchModeStart) OK_STUB(HcommBatchTransferOnThread) OK_STUB(HcommChannelCreate)
OK_STUB(HcommChannelDestroy) OK_STUB(HcommChannelFence) OK_STUB(HcommChannelFenceOnThread) OK_STUB(HcommChannelGetStatus)
OK_STUB(HcommChannelUpdateMemInfo) OK_STUB(HcommEndpointCreate) OK_STUB(HcommEndpointDestroy)
OK_STUB(HcommEndpointGetListenPort) OK_STUB(HcommMemExport) OK_STUB(HcommMemGetAllMemHandles) OK_STUB(HcommMemImport)
OK_STUB(HcommMemReg) OK_STUB(HcommMemUnimport) OK_STUB(HcommMemUnreg) OK_STUB(HcommReadNbi) OK_STUB(HcommReadNbiOnThread)
OK_STUB(HcommReadOnThread) OK_STUB(HcommThreadAlloc) OK_STUB(HcommThreadFree) OK_STUB(HcommWriteNbi)
OK_STUB(HcommWriteNbiOnThread) OK_STUB(HcommWriteOnThread)
