// Pipelines across processes and hosts, over torch's c10d (Gloo on CPU).
//
// Each process runs one pipeline rank of one replica: with P pipeline ranks
// and D data-parallel replicas the world has D x P processes, and process
// `rank` runs pipeline rank rank % P of replica rank / P. Rendezvous follows
// torchrun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (Open
// MPI's OMPI_COMM_WORLD_* and SLURM's SLURM_PROCID / SLURM_NTASKS also
// work); rank 0 hosts the TCPStore. Without MASTER_ADDR everything runs on
// the loopback address.
//
//   # two processes on one host
//   tpipe launch --nproc 2 configs/mlp_synthetic.json
//   # two hosts, one process each (the same command on both, RANK 0 or 1)
//   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0
//       tpipe train configs/mlp_synthetic.json
//
// Faults never hang: a peer that dies closes its connections (the others
// fail at once), and one that stops answering is given up on after the
// timeout; either way the error names the lost rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tpipe {

struct WorldInfo {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  bool fromEnvironment = false;  // false: a single process
};

// Reads the rendezvous variables; worldSize 1 when none are set. Throws
// c10::Error naming a malformed or inconsistent variable.
WorldInfo worldFromEnvironment();

// Owns the store and process groups of this process. Blocks in the
// constructor until every process of the world has joined (or the timeout).
class Communicator {
 public:
  Communicator(const WorldInfo& world, int pipelineRanks, std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int worldSize() const;
  int pipelineRanks() const;  // P
  int replicas() const;       // D = worldSize / P
  int replica() const;        // rank / P
  int stageRank() const;      // rank % P
  std::chrono::milliseconds timeout() const;

  // Sums over every process (each passes its own part).
  std::vector<double> sum(const std::vector<double>& values);
  // Rank 0's values, on every process.
  std::vector<int64_t> broadcast(const std::vector<int64_t>& values);
  // Averages gradients across the replicas of this process's pipeline rank,
  // in buckets of about 25 MB.
  void averageAcrossReplicas(const std::vector<at::Tensor>& gradients);
  void barrier();

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Starts `processes` local ranks of `tpipe train <arguments>` with the
// rendezvous variables set, prefixes each rank's output with "[rank k] ",
// forwards SIGINT/SIGTERM, and, when any rank fails, ends the others.
// Returns 0 when all succeed, else the first failure's exit status.
int launchLocal(const std::string& executable, int processes, const std::vector<std::string>& arguments);

}  // namespace tpipe
