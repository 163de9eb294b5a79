// A minimal safetensors reader: the 8-byte header length, the JSON header (tensor name ->
// dtype, shape, data_offsets) and the raw little-endian data. Only what tinylm needs: F32.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace tinylm {

struct tensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    return n;
  }
};

namespace detail {
// Just enough JSON for safetensors headers: objects, arrays, strings, integers.
class json_cursor {
 public:
  explicit json_cursor(const std::string& s) : s_(s) {}
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool consume(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) throw std::runtime_error(std::string("safetensors header: expected '") + c + "'");
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\' && i_ + 1 < s_.size()) ++i_;
      out += s_[i_++];
    }
    expect('"');
    return out;
  }
  std::int64_t integer() {
    ws();
    std::size_t used = 0;
    const long long v = std::stoll(s_.substr(i_, 32), &used);
    i_ += used;
    return v;
  }
  std::vector<std::int64_t> int_array() {
    std::vector<std::int64_t> v;
    expect('[');
    if (consume(']')) return v;
    do v.push_back(integer());
    while (consume(','));
    expect(']');
    return v;
  }
  void skip_value() {
    ws();
    if (s_[i_] == '"') {
      string();
    } else if (s_[i_] == '{' || s_[i_] == '[') {
      const char open = s_[i_], close = open == '{' ? '}' : ']';
      int depth = 0;
      bool in_string = false;
      for (; i_ < s_.size(); ++i_) {
        const char c = s_[i_];
        if (in_string) {
          if (c == '\\')
            ++i_;
          else if (c == '"')
            in_string = false;
        } else if (c == '"') {
          in_string = true;
        } else if (c == open) {
          ++depth;
        } else if (c == close && --depth == 0) {
          ++i_;
          return;
        }
      }
    } else {
      while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != '}' && s_[i_] != ']') ++i_;
    }
  }

 private:
  const std::string& s_;
  std::size_t i_ = 0;
};
}  // namespace detail

/// Loads every tensor of a safetensors file (F32 only).
inline std::map<std::string, tensor> load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, ' ');
  f.read(&header[0], static_cast<std::streamsize>(header_len));
  std::vector<char> blob((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());

  std::map<std::string, tensor> out;
  detail::json_cursor c(header);
  c.expect('{');
  if (c.consume('}')) return out;
  do {
    const std::string name = c.string();
    c.expect(':');
    if (name == "__metadata__") {
      c.skip_value();
      continue;
    }
    std::string dtype;
    std::vector<std::int64_t> shape, offsets;
    c.expect('{');
    do {
      const std::string key = c.string();
      c.expect(':');
      if (key == "dtype")
        dtype = c.string();
      else if (key == "shape")
        shape = c.int_array();
      else if (key == "data_offsets")
        offsets = c.int_array();
      else
        c.skip_value();
    } while (c.consume(','));
    c.expect('}');
    if (dtype != "F32") throw std::runtime_error(name + ": only F32 tensors are supported, got " + dtype);
    if (offsets.size() != 2 || offsets[1] > static_cast<std::int64_t>(blob.size()))
      throw std::runtime_error(name + ": bad data_offsets");
    tensor t;
    t.shape = shape;
    t.data.resize(static_cast<std::size_t>(t.numel()));
    if (static_cast<std::int64_t>(t.data.size() * sizeof(float)) != offsets[1] - offsets[0])
      throw std::runtime_error(name + ": size does not match its shape");
    std::memcpy(t.data.data(), blob.data() + offsets[0], t.data.size() * sizeof(float));
    out.emplace(name, std::move(t));
  } while (c.consume(','));
  c.expect('}');
  return out;
}

}  // namespace tinylm
