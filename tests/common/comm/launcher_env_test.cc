// parse_rank_env under the three launchers (Note [launchers] in init_from_env.cc): torchrun-style variables,
// mpirun's OMPI_COMM_WORLD_*, Slurm's SLURM_*, their MASTER_ADDR / MASTER_PORT defaults, and Slurm host lists.
#include <map>
#include <string>

#include "common/comm/init_from_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<ProcessRankEnv> parse(const std::map<std::string, std::string>& vars) {
  return parse_rank_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(LauncherEnv, MpirunOnOneHostNeedsNoStoreAddress) {
  auto env = parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "mpirun");
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(LauncherEnv, MpirunAcrossHostsAsksForMasterAddr) {
  auto env = parse({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  ASSERT_FALSE(env.ok());
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_ADDR"));
  EXPECT_THAT(env.status().message(), HasSubstr("mpirun -x MASTER_ADDR"));
  auto given = parse({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                      {"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "4242"}});
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->master_addr, "10.0.0.7");
  EXPECT_EQ(given->master_port, 4242);
  EXPECT_EQ(given->local_rank, 5);  // _LOCAL_RANK unset: the rank
}

TEST(LauncherEnv, SlurmTakesTheFirstHostOfTheNodeList) {
  auto env = parse({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_JOB_NODELIST", "cn[007-010,12],gpu1"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "slurm");
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "cn007");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(LauncherEnv, TorchrunVariablesWinInsideAnAllocation) {
  auto env = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "7"},
                    {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}});
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->launcher, "shardrun");
  EXPECT_EQ(env->rank, 1);
}

TEST(LauncherEnv, ErrorsNameTheLaunchersVariable) {
  auto env = parse({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "a"}});
  ASSERT_FALSE(env.ok());
  EXPECT_THAT(env.status().message(),
              HasSubstr("expected environment variable SLURM_PROCID to be an integer in [0, SLURM_NTASKS=4), found '9'"));
  auto bad_list = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NODELIST", "[1-2]"}});
  ASSERT_FALSE(bad_list.ok());
  EXPECT_THAT(bad_list.status().message(), HasSubstr("SLURM_JOB_NODELIST"));
}

TEST(FirstSlurmHost, ExpandsTheFirstEntry) {
  EXPECT_EQ(*first_slurm_host("node01"), "node01");
  EXPECT_EQ(*first_slurm_host("gpu3,gpu4"), "gpu3");
  EXPECT_EQ(*first_slurm_host("node[01-04,07],gpu3"), "node01");
  EXPECT_EQ(*first_slurm_host("rack[5,9]-n"), "rack5-n");
  EXPECT_FALSE(first_slurm_host("").ok());
  EXPECT_FALSE(first_slurm_host("node[]").ok());
  EXPECT_FALSE(first_slurm_host("node[a-b]").ok());
  EXPECT_FALSE(first_slurm_host("node[1-2").ok());
}

}  // namespace
}  // namespace shardkit::comm
