/*
 * The Ascend Transformer Boost (ATB) types the STAND-IN libatb.so exposes, for memscope-bpf's
 * tests. It is not ATB's header.
 *
 * What matters to a tracer is the ABI: the mangled name of atb::Runner::Execute and where the
 * workspace fields sit inside the RunnerVariantPack it is handed. The members below follow the
 * declarations of the open-source ATB (include/atb/types.h, include/atb/svector.h and
 * src/atb/utils/runner_variant_pack.h of hicann/ascend-transformer-boost) in order and type, so
 * the offsets the tracer finds in this file's DWARF are the ones it assumes for a stripped real
 * libatb.so (memscope-user/src/apis/atb.rs, FALLBACK_OFFSETS). Member functions are left out.
 *
 * Also included by memscope-user's unit test that checks those fallback offsets.
 */
#ifndef MEMSCOPE_ATB_STANDIN_H
#define MEMSCOPE_ATB_STANDIN_H

#include <cstddef>
#include <cstdint>
#include <string>

/* ACL's enums are int-sized. */
enum aclDataType { ACL_DT_UNDEFINED = -1 };
enum aclFormat { ACL_FORMAT_UNDEFINED = -1 };

namespace atb {

using Status = int32_t;
constexpr uint32_t MAX_DIM = 8;
constexpr size_t DEFAULT_SVECTOR_SIZE = 64;

struct Dims {
    int64_t dims[MAX_DIM];
    uint64_t dimNum = 0;
};

struct TensorDesc {
    aclDataType dtype = ACL_DT_UNDEFINED;
    aclFormat format = ACL_FORMAT_UNDEFINED;
    Dims shape;
};

struct Tensor {
    TensorDesc desc;
    void *deviceData = nullptr;
    void *hostData = nullptr;
    uint64_t dataSize = 0;
};

/* ATB's small vector: inline storage for 64 elements (plus one), a heap pointer past that. */
template <class T> class SVector {
  public:
    size_t size() const { return size_; }

  private:
    size_t capacity_ = 0;
    size_t size_ = 0;
    T storage_[DEFAULT_SVECTOR_SIZE + 1];
    T *heap_ = nullptr;
};

class ContextBase;
class MstxMemRegister;

/* What a runner is executed with. The caller's workspace is split in two: the kernels' own
 * scratch (workspaceBuffer, workspaceBufferSize) and, right after it, the graph's intermediate
 * tensors (intermediateBuffer, intermediateBufferSize), the part ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE
 * lays out. */
struct RunnerVariantPack {
    SVector<Tensor> inTensors;
    SVector<Tensor> outTensors;
    SVector<bool> isInTensorCanFree;
    SVector<bool> isOutTensorNeedMalloc;
    uint8_t *hostTilingBuffer = nullptr;
    uint8_t *tilingBuffer = nullptr;
    uint64_t tilingBufferSize = 0;
    uint8_t *workspaceBuffer = nullptr;
    uint64_t workspaceBufferSize = 0;
    uint8_t *intermediateBuffer = nullptr;
    uint64_t intermediateBufferSize = 0;
    uint8_t *argsDeviceBuffer = nullptr;
    uint8_t *argsHostBuffer = nullptr;
    ContextBase *context = nullptr;
    MstxMemRegister *mstxMemRegister = nullptr;
};

class Runner {
  public:
    explicit Runner(const std::string &name);
    virtual ~Runner();
    Status Execute(RunnerVariantPack &runnerVariantPack);
    const std::string &GetName() const { return name_; }
    /* Executions so far: the stand-in's own counter, for the test's ledger. */
    uint64_t executeCount() const { return executeCount_; }

  private:
    std::string name_;
    uint64_t executeCount_ = 0;
};

}  // namespace atb

#endif
