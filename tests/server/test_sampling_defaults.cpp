// The server's sampling defaults from a model's generation_config.json (sampling_defaults.h):
// the keys it reads, the ones it ignores, and a clear error for every bad value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "server/sampling_defaults.h"

namespace uf::server {
namespace {

class SamplingDefaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("uf_sampling_defaults_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string write(const std::string& text) {
    const auto path = (dir_ / "generation_config.json").string();
    std::ofstream(path) << text;
    return path;
  }

  // The message of the error loading `text` raises ("" when it loads).
  std::string error_of(const std::string& text) {
    try {
      load_sampling_defaults(write(text));
    } catch (const core::Error& e) {
      return e.what();
    }
    return "";
  }

  std::filesystem::path dir_;
};

TEST_F(SamplingDefaultsTest, ReadsTemperatureTopPTopKAndIgnoresTheRest) {
  const auto p = load_sampling_defaults(
      write(R"({"_from_model_config": true, "bos_token_id": 0, "eos_token_id": 1,
               "do_sample": false, "temperature": 1.0, "top_p": 0.95, "top_k": 20,
               "transformers_version": "4.46.3"})"));
  EXPECT_DOUBLE_EQ(p.temperature, 1.0);
  EXPECT_DOUBLE_EQ(p.top_p, 0.95);
  EXPECT_EQ(p.top_k, 20);
  EXPECT_FALSE(p.seed);
  EXPECT_EQ(describe_sampling(p), "temperature 1, top_p 0.95, top_k 20");
}

TEST_F(SamplingDefaultsTest, MissingOrNullKeysKeepOpenAIsDefaults) {
  const auto p = load_sampling_defaults(write(R"({"temperature": 0.6, "top_p": null})"));
  EXPECT_DOUBLE_EQ(p.temperature, 0.6);
  EXPECT_DOUBLE_EQ(p.top_p, 1.0);
  EXPECT_EQ(p.top_k, 0);
  EXPECT_EQ(load_sampling_defaults(write(R"({"top_k": -1})")).top_k, 0);
  EXPECT_EQ(describe_sampling(load_sampling_defaults(write("{}"))),
            "temperature 1, top_p 1, top_k off");
}

TEST_F(SamplingDefaultsTest, BadValuesNameTheFileAndTheKey) {
  EXPECT_NE(error_of(R"({"temperature": 2.5})").find("'temperature' = 2.5 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"temperature": "hot"})").find("'temperature' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"top_p": 0})").find("'top_p' = 0 is out of range: it must lie in (0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"top_p": 1.5})").find("'top_p'"), std::string::npos);
  EXPECT_NE(error_of(R"({"top_k": 2.5})").find("'top_k' must be an integer"), std::string::npos);
  EXPECT_NE(error_of(R"({"top_k": -2})").find("'top_k'"), std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(error_of("{\"top_p\": ").find("is not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"temperature": 3})").find("generation_config.json"), std::string::npos);
  EXPECT_THROW(load_sampling_defaults((dir_ / "absent.json").string()), core::Error);
}

}  // namespace
}  // namespace uf::server
