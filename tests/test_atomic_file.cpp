// AtomicFileWriter and its users (Session::save, GgufWriter::write): a save never damages
// what is at the target path. Non-regular targets are refused and stay what they were,
// symbolic links are followed (the link stays), permissions are kept, and a full disk in
// the middle of a save leaves the old file byte-identical with no temporary file behind.
#include <catch2/catch.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>

#include "file_size_limit.hpp"
#include "kv_test_support.hpp"
#include "tandem/core/atomic_file.hpp"
#include "tandem/gguf/gguf_writer.hpp"

using namespace tandem;

namespace {

std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void save_text(const std::filesystem::path& p, const std::string& s) {
  write_file_atomic(p, std::as_bytes(std::span<const char>(s.data(), s.size())));
}

ErrorCode error_of(const std::function<void()>& fn, std::string* what = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  return ErrorCode::kOk;
}

mode_t mode_of(const std::filesystem::path& p) {
  struct stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return st.st_mode;
}

// Names in `dir` (temporary files left behind would show here).
std::vector<std::string> names_in(const std::filesystem::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : std::filesystem::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("atomic save refuses devices, FIFOs, directories and sockets and leaves them as they were",
          "[atomic-file][faults]") {
  const auto dir = test::scratch_dir("atomic-kinds");
  std::string what;
  CHECK(error_of([] { save_text("/dev/full", "x"); }, &what) == ErrorCode::kInvalidArgument);
  CHECK(what.find("character device") != std::string::npos);
  CHECK(S_ISCHR(mode_of("/dev/full")));

  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  CHECK(error_of([&] { save_text(dir / "fifo", "x"); }, &what) == ErrorCode::kInvalidArgument);
  CHECK(what.find("FIFO") != std::string::npos);
  CHECK(S_ISFIFO(mode_of(dir / "fifo")));

  std::filesystem::create_directory(dir / "sub");
  CHECK(error_of([&] { save_text(dir / "sub", "x"); }, &what) == ErrorCode::kInvalidArgument);
  CHECK(what.find("directory") != std::string::npos);
  CHECK(error_of([&] { save_text(dir / "sub/", "x"); }) == ErrorCode::kInvalidArgument);
  CHECK(S_ISDIR(mode_of(dir / "sub")));

  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(sock >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sp = (dir / "sock").string();
  REQUIRE(sp.size() < sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, sp.c_str(), sp.size() + 1);
  REQUIRE(::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  CHECK(error_of([&] { save_text(dir / "sock", "x"); }, &what) == ErrorCode::kInvalidArgument);
  CHECK(what.find("socket") != std::string::npos);
  CHECK(S_ISSOCK(mode_of(dir / "sock")));
  ::close(sock);

  CHECK(error_of([&] { save_text(dir / "missing-dir" / "f", "x"); }) == ErrorCode::kIo);
  CHECK(error_of([&] { save_text("", "x"); }) == ErrorCode::kInvalidArgument);
  CHECK(names_in(dir) == std::vector<std::string>{"fifo", "sock", "sub"});  // nothing else created
}

TEST_CASE("atomic save follows symbolic links, keeps permissions and creates new files with the umask",
          "[atomic-file][faults]") {
  const auto dir = test::scratch_dir("atomic-links");
  std::filesystem::create_directory(dir / "real");
  save_text(dir / "real" / "data", "old");
  ::chmod((dir / "real" / "data").c_str(), 0640);
  // link2 -> link1 -> real/data, link1 relative to its own directory.
  std::filesystem::create_symlink("real/data", dir / "link1");
  std::filesystem::create_symlink(dir / "link1", dir / "link2");
  save_text(dir / "link2", "new contents");
  CHECK(S_ISLNK(mode_of(dir / "link1")));
  CHECK(S_ISLNK(mode_of(dir / "link2")));
  CHECK(read_text(dir / "real" / "data") == "new contents");
  CHECK((mode_of(dir / "real" / "data") & 07777) == 0640);
  CHECK(names_in(dir / "real") == std::vector<std::string>{"data"});  // the temporary went there, and is gone

  // A dangling link: the file is created where it points.
  std::filesystem::create_symlink("real/later", dir / "dangling");
  save_text(dir / "dangling", "created");
  CHECK(S_ISLNK(mode_of(dir / "dangling")));
  CHECK(read_text(dir / "real" / "later") == "created");

  const mode_t mask = ::umask(022);
  save_text(dir / "fresh", "x");
  ::umask(mask);
  CHECK((mode_of(dir / "fresh") & 07777) == 0644);
}

TEST_CASE("a full disk during a save leaves the old file intact and no temporary behind", "[atomic-file][faults]") {
  const auto dir = test::scratch_dir("atomic-full");
  const std::string old(1000, 'o');
  save_text(dir / "f", old);
  {
    test::FileSizeLimit full(4096);
    std::string what;
    CHECK(error_of([&] { save_text(dir / "f", std::string(100000, 'n')); }, &what) == ErrorCode::kIo);
    CHECK(what.find("File too large") != std::string::npos);
    CHECK(what.find("unchanged") != std::string::npos);
  }
  CHECK(read_text(dir / "f") == old);
  CHECK(names_in(dir) == std::vector<std::string>{"f"});

  // A writer destroyed without commit() changes nothing either.
  {
    AtomicFileWriter w(dir / "f");
    w.write("abc", 3);
  }
  CHECK(read_text(dir / "f") == old);
  CHECK(names_in(dir) == std::vector<std::string>{"f"});
}

TEST_CASE("Session::save and GgufWriter::write go through the atomic writer", "[atomic-file][session][faults]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("atomic-session");
  Session s(model, ex);
  GenerateOptions go;
  go.max_tokens = 4;
  go.sampling = SamplingParams::greedy();
  s.generate("Once upon a time", go);

  CHECK(error_of([&] { s.save("/dev/full"); }) == ErrorCode::kInvalidArgument);
  CHECK(S_ISCHR(mode_of("/dev/full")));

  std::filesystem::create_directory(dir / "store");
  std::filesystem::create_symlink("store/s.session", dir / "s.session");
  s.save(dir / "s.session");
  const size_t n_saved = s.tokens().size();
  CHECK(S_ISLNK(mode_of(dir / "s.session")));
  const std::string saved = read_text(dir / "store" / "s.session");
  CHECK(saved.size() > 100);

  s.generate(" The", go);  // more tokens: a longer file that no longer fits
  {
    test::FileSizeLimit full(saved.size());
    CHECK(error_of([&] { s.save(dir / "s.session"); }) == ErrorCode::kIo);
  }
  CHECK(read_text(dir / "store" / "s.session") == saved);
  Session back(model, ex);
  back.restore(dir / "s.session");
  CHECK(back.tokens().size() == n_saved);  // the state of the first save
  CHECK(s.tokens().size() > n_saved);

  GgufWriter w;
  w.add_string("general.architecture", "llama");
  CHECK(error_of([&] { w.write("/dev/full"); }) == ErrorCode::kInvalidArgument);
  CHECK(S_ISCHR(mode_of("/dev/full")));
}
